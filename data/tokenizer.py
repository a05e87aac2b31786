"""Train the vision-language chat tokenizer (byte-level BPE) on the text of WebDataset shards.

    python -m data.tokenizer --shards SPEC [--shards SPEC ...] --out DIR [--vocab-size 1024]
                             [--max-samples N]                          (or train_from_shards)

Reads every sample's `txt` caption and the turns of its `json` conversation (image markers split
out) in shard order, the first N samples with --max-samples, and writes DIR/tokenizer.json and
DIR/tokenizer_config.json (chat template included): the folder `ChatTokenizer.load` and
`transformers.AutoTokenizer.from_pretrained` read. The format and special tokens are those of
common/data/chat.py. A sample is skipped, counted by reason, when its json does not parse, its
turns are not a conversation the chat template accepts (what the VLM decoder would skip too), or
it has no text at all. Same shards and arguments -> byte-identical files.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

STATS_SAMPLES = 2000  # samples kept to measure tokens per caption / conversation after training


@dataclass
class ReadStats:
    shards: int = 0
    read: int = 0
    used: int = 0
    texts: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> samples
    kept: list = field(default_factory=list)  # (caption | None, turns | None) of the first STATS_SAMPLES used


def _texts(specs, max_samples: int | None, progress: bool, stats: ReadStats) -> Iterator[str]:
    import json

    from tqdm import tqdm

    from common.data.chat import sample_texts
    from common.data.shards import ShardIndex, expand_shards
    index = ShardIndex(expand_shards(specs))
    stats.shards = len(index.paths)
    total = len(index) if max_samples is None else min(max_samples, len(index))
    bar = tqdm(total=total, unit="sample", desc="reading", disable=not progress, file=sys.stderr, mininterval=1.0)
    try:
        for shard_id, size in enumerate(index.shard_sizes):
            for sample_id in range(size):
                if stats.read == total:
                    return
                sample = index.read(shard_id, sample_id)
                stats.read += 1
                bar.update(1)
                try:
                    texts = sample_texts(sample)
                except UnicodeDecodeError:
                    stats.skipped["text is not UTF-8"] += 1
                    continue
                except json.JSONDecodeError:
                    stats.skipped["json does not parse"] += 1
                    continue
                except ValueError as e:  # the conversation check's one-line reasons
                    stats.skipped[re.sub(r"^turn \d+", "a turn", str(e))] += 1
                    continue
                if not texts:
                    stats.skipped["no txt caption and no json turns"] += 1
                    continue
                stats.used += 1
                stats.texts += len(texts)
                if len(stats.kept) < STATS_SAMPLES:
                    cap = sample.get("txt")
                    meta = json.loads(sample["json"]) if sample.get("json") else {}
                    turns = meta.get("turns") if isinstance(meta, dict) else None
                    stats.kept.append((cap.decode("utf-8").strip() if cap else None, turns))
                yield from texts
    finally:
        bar.close()


def train_from_shards(specs: str | Sequence[str], vocab_size: int = 1024, max_samples: int | None = None, *,
                      progress: bool = False, stats: ReadStats | None = None):
    """A ChatTokenizer trained on the captions and conversation turns of `specs` (shard specs as
    `common.data.shards.expand_shards` takes them), reading at most `max_samples` samples. Fills
    `stats` when given. DataError when the shards are missing or hold no text; ValueError for a
    vocab_size below chat.MIN_VOCAB_SIZE or max_samples < 1."""
    from common.data.chat import MIN_VOCAB_SIZE, train_bpe
    from common.data.shards import DataError
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab size must be at least {MIN_VOCAB_SIZE} (256 bytes + the special tokens), "
                         f"got {vocab_size}")  # fmt: skip
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max samples must be >= 1, got {max_samples}")
    stats = ReadStats() if stats is None else stats
    texts = _texts(specs, max_samples, progress, stats)
    next_text = next(texts, None)  # opens the shards first: a bad spec fails before training starts
    if next_text is None:
        why = ", ".join(f"{n} {r}" for r, n in stats.skipped.most_common(3))
        raise DataError(f"no text found in {stats.read} samples of {stats.shards} shard(s)"
                        + (f" (skipped: {why})" if why else ""))
    return train_bpe(_chain(next_text, texts), vocab_size)


def _chain(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest


def _mean(values: list[int]) -> str:
    return f"{sum(values) / len(values):.1f}" if values else "-"


def summary(tok, stats: ReadStats, vocab_size: int | None = None) -> list[str]:
    """The lines the CLI prints: counts, skip reasons, vocab size, mean tokens per caption and per
    conversation (template included, image tokens excluded) over the first STATS_SAMPLES used samples."""
    caps = [len(tok.encode_text(c)) for c, _ in stats.kept if c]
    convs = []
    for _, turns in stats.kept:
        if turns:
            ids = tok.encode_conversation(turns, 1).ids
            convs.append(len(ids) - ids.count(tok.image_token_id))
    skipped = sum(stats.skipped.values())
    lines = [f"read {stats.read} samples from {stats.shards} shard(s): {stats.used} used, {skipped} skipped"]
    lines += [f"  skipped {n}: {reason}" for reason, n in stats.skipped.most_common()]
    fewer = (f"; {vocab_size} asked, the text holds fewer merges seen twice"
             if vocab_size is not None and tok.vocab_size < vocab_size else "")
    lines.append(f"vocab size {tok.vocab_size} (special tokens at ids {tok.pad_id}-{tok.image_token_id}{fewer})")
    measured = f", measured on the first {STATS_SAMPLES} samples used" if stats.used > STATS_SAMPLES else ""
    lines.append(f"mean tokens per caption {_mean(caps)} over {len(caps)} captions; per conversation "
                 f"{_mean(convs)} over {len(convs)} conversations (template included, image tokens "
                 f"excluded{measured})")  # fmt: skip
    return lines


def _check_out(out: str) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out!r} exists and is not a folder")
    if os.path.isdir(out) and os.listdir(out) and not os.path.isfile(os.path.join(out, "tokenizer.json")):
        raise ValueError(f"--out {out!r} is a non-empty folder without a tokenizer.json: refusing to write "
                         "into it (give a new or empty folder, or an existing tokenizer folder to replace)")


def _parser() -> argparse.ArgumentParser:
    from common.data.chat import MIN_VOCAB_SIZE
    p = argparse.ArgumentParser(
        prog="python -m data.tokenizer",
        description="Train the byte-level BPE chat tokenizer of the vision-language pipeline on the "
        "captions (txt) and conversation turns (json 'turns', image markers split out) of WebDataset "
        "shards, e.g. those of `python -m data.synth --vqa` or `python -m data.make_shards "
        "conversations`. Writes OUT/tokenizer.json and OUT/tokenizer_config.json (eos/pad tokens and "
        "the chat template), loadable by ChatTokenizer.load and transformers.AutoTokenizer. Prints "
        "samples read and skipped (by reason), the vocab size and mean tokens per caption and per "
        "conversation. Same shards and arguments -> byte-identical files.",
    )
    p.add_argument("--shards", action="append", required=True, metavar="SPEC",
                   help="folder, brace pattern, glob or tar file; repeat to read several in order")
    p.add_argument("--out", required=True,
                   help="output folder: new, empty, or an existing tokenizer folder (its files are replaced)")
    p.add_argument("--vocab-size", type=int, default=1024,
                   help=f"largest vocab, special tokens and the 256 byte tokens included (>= {MIN_VOCAB_SIZE}; "
                   "default 1024); smaller when the text holds fewer merges seen twice")
    p.add_argument("--max-samples", type=int, default=None,
                   help="read only the first N samples in shard order (default: all)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    from common.data.shards import DataError
    a = _parser().parse_args(argv)
    t0 = time.time()
    stats = ReadStats()
    try:
        _check_out(a.out)
        tok = train_from_shards(a.shards, a.vocab_size, a.max_samples, progress=not a.no_progress, stats=stats)
        tok.save(a.out)
    except (DataError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in summary(tok, stats, a.vocab_size):
        print(line)
    print(f"wrote {os.path.join(a.out, 'tokenizer.json')} and tokenizer_config.json ({time.time() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
