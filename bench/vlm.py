"""The vlm pipeline's two balance questions side by side: packed vs padded training tokens/s of
the tiny VLM (configs/tiny.yaml sizes, CPU fp32), and the slowest data-parallel rank's ViT FLOPs
over the mean with and without balanced tile dispatch.

Packing: real synthetic VQA conversations (python -m data.synth --vqa) decoded by the pipeline's
own decoder, one micro-batch run two ways with the same samples: packed rows (varlen attention)
and one sample per padded row. A step is forward + backward of the whole model (stage full);
tokens/s counts real (non-pad) tokens, the same for both. Two mixes:
  vqa      the synthetic conversations as they are (2-4 short turns: lengths within ~2x),
  skewed   multi-turn conversations of 1 to 40 of those question/answer pairs about one image
           (log-normal, median 2: most short, a few long), as instruction data mixes are; rows of
           512 tokens.
ViT balance: bench/vit_balance.py's simulated mixed-resolution stream (run that for options).

  python bench/vlm.py [--data DIR] [--samples N] [--steps N] [--json OUT]
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common.config import build_config  # noqa: E402
from common.data.chat import train_bpe  # noqa: E402
from common.data.shards import iter_samples  # noqa: E402
from pipelines.vlm.components import build_vlm, tokens_per_tile  # noqa: E402
from pipelines.vlm.config import VLMConfig  # noqa: E402
from pipelines.vlm.data import PackCollate, VLMDecoder  # noqa: E402
from pipelines.vlm.model import lm_loss  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "pipelines/vlm/configs/tiny.yaml")


def raw_samples(data: str, n: int) -> list[dict]:
    out = []
    for raw in iter_samples(data):
        out.append(raw)
        if len(out) == n:
            break
    if len(out) < n:
        raise SystemExit(f"{data}: {len(out)} samples, need {n} (python -m data.synth --vqa --out ...)")
    return out


def skewed(raws: list[dict], seed: int) -> list[dict]:
    """Multi-turn conversations: sample i keeps its image and gets k ~ log-normal question/answer
    pairs drawn from the pool (the first keeps the image marker)."""
    rng = random.Random(seed)
    pairs = []
    for raw in raws:
        turns = json.loads(raw["json"])["turns"]
        pairs += [(turns[i]["content"].replace("<image>\n", ""), turns[i + 1]["content"]) for i in range(0, len(turns), 2)]
    out = []
    for raw in raws:
        k = max(1, min(40, round(math.exp(rng.gauss(math.log(2.0), 1.1)))))
        chosen = rng.sample(pairs, k)
        turns = []
        for j, (q, a) in enumerate(chosen):
            turns += [{"role": "user", "content": ("<image>\n" if j == 0 else "") + q},
                      {"role": "assistant", "content": a}]
        meta = json.loads(raw["json"])
        meta["turns"] = turns
        out.append(dict(raw, json=json.dumps(meta).encode()))
    return out


def step_seconds(model, batch) -> float:
    t0 = time.perf_counter()
    logits = model(batch["tokens"], batch["positions"], batch["tiles"], batch["tile_mask"])
    lm_loss(logits, torch.stack([batch["targets"], batch["positions"]], 1)).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def compare(name: str, model, decoded: list[dict], row_len: int, pad_id: int, steps: int) -> dict:
    batches = {"packed": PackCollate(row_len, pad_id, packed=True)(decoded),
               "padded": PackCollate(row_len, pad_id, packed=False)(decoded)}
    lengths = sorted(len(d["ids"]) for d in decoded)
    real = sum(lengths)
    times = {k: [] for k in batches}
    for i in range(steps + 1):  # alternate, so load changes hit both sides; step 0 warms up
        for kind, b in batches.items():
            dt = step_seconds(model, b)
            if i:
                times[kind].append(dt)
    row = {"mix": name, "samples": len(decoded), "len_min": lengths[0], "len_median": lengths[len(lengths) // 2],
           "len_max": lengths[-1], "real_tokens": real}
    for kind, b in batches.items():
        assert b["num_tokens"] == real
        dt = sorted(times[kind])[len(times[kind]) // 2]
        row[kind] = {"shape": list(b["tokens"].shape), "pad_fraction": 1 - real / b["tokens"].numel(), "step_s": dt,
                     "tokens_per_s": real / dt}
    row["ratio"] = row["packed"]["tokens_per_s"] / row["padded"]["tokens_per_s"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=os.path.join(ROOT, "datasets/vqa/train"), help="VQA training shards")
    p.add_argument("--samples", type=int, default=32, help="samples per micro-batch (tiny.yaml: 32)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per side (after one warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "vlm.json"))
    args = p.parse_args()
    raws = raw_samples(args.data, args.samples)
    texts = [t["content"] for r in raws for t in json.loads(r["json"])["turns"]]
    tok = train_bpe(texts * 4, 512)
    cfg = build_config(VLMConfig, TINY, ["stage.name=full", "stages=[]", "packing.row_len=1024", "lm.max_seq_len=1024"])
    torch.manual_seed(args.seed)
    model = build_vlm(cfg, tok)
    dec = VLMDecoder(tok, tile=cfg.clip.image_size, max_tiles=cfg.model.max_tiles, tokens_per_tile=tokens_per_tile(cfg),
                     row_len=cfg.packing.row_len)
    print(f"threads {torch.get_num_threads()}, tiny VLM (ViT {cfg.clip.layers}x{cfg.clip.width}, Llama "
          f"{cfg.lm.n_layers}x{cfg.lm.dim}), fp32, {args.samples} samples per micro-batch")
    rows = []
    for name, batch in (("vqa", raws), ("skewed", skewed(copy.deepcopy(raws), args.seed))):
        decoded = [dec(r) for r in batch]
        row_len = max(256 if name == "vqa" else 512, max(len(d["ids"]) for d in decoded))
        rows.append(compare(name, model, decoded, row_len, tok.pad_id, args.steps))
    print(f"{'mix':7} {'len min/med/max':>16}   {'packed rows':>11} {'pad':>6} {'tokens/s':>9}   "
          f"{'padded rows':>11} {'pad':>6} {'tokens/s':>9}   packed/padded")
    for r in rows:
        cells = [f"{'x'.join(map(str, r[k]['shape'])):>11} {r[k]['pad_fraction']:6.1%} {r[k]['tokens_per_s']:9.0f}"
                 for k in ("packed", "padded")]
        print(f"{r['mix']:7} {str(r['len_min']) + '/' + str(r['len_median']) + '/' + str(r['len_max']):>16}   "
              f"{cells[0]}   {cells[1]}   {r['ratio']:.2f}x")
    from vit_balance import simulate
    print("\nViT FLOPs, slowest data-parallel rank / mean (mixed-resolution stream, 4 samples per rank, 1000 steps)")
    print(f"{'ranks':>5} {'plain':>7} {'balanced':>9}")
    balance = []
    for d in (2, 4, 8):
        b = simulate(d, 4, 1000, cfg.model.max_tiles, args.seed)
        balance.append(b)
        print(f"{d:5d} {b['plain']['sum']:7.3f} {b['balanced']['sum']:9.3f}")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"threads": torch.get_num_threads(), "packing": rows, "vit_balance": balance}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
