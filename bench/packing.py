"""Packed varlen rows against padded batches: training tokens/s of a small Llama on CPU (fp32).

The same samples are run two ways, side by side: packed into fixed rows by
common.data.packing.pack_samples (varlen attention through cu_seqlens), and padded one sample per
row to the longest (pad_batch, plain causal attention). A step is forward + backward of the
token-averaged assistant loss; tokens/s counts real (non-pad) tokens, the same for both, so the
ratio is the speed-up per useful token. Two mixes:
  skewed  lengths drawn long-tailed (log-normal: many short conversations, a few long ones),
  equal   every sample the same length: nothing to pad, so packing can only cost (its per-
          sequence attention loop); a ratio near 1 says padding costs nothing there.
Data loading is excluded (samples are made up in memory); kernels use the default backend. Each
side's step time is the median of its timed steps, taken alternately with the other side's.

  python bench/packing.py [--steps N] [--samples N] [--row-len L] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.data.packing import pack_samples, packed_loss, pad_batch  # noqa: E402
from common.nn import Llama, LlamaConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=1024, ffn_hidden=384)


def make_samples(lengths: list[int], vocab: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token ids with an assistant answer filling the second half of each conversation."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(1, vocab, (n,), generator=g), torch.arange(n) >= n // 2) for n in lengths]


def skewed_lengths(n: int, row_len: int, seed: int) -> list[int]:
    # Log-normal with median row_len / 16 and sigma 1: most conversations short, a tail to the
    # row length; one sample at the row length so the padded batch pads to it, as a loader
    # batch with one long conversation does.
    g = torch.Generator().manual_seed(seed)
    lens = torch.exp(math.log(row_len / 16) + torch.randn(n - 1, generator=g)).round().clamp(4, row_len)
    return [row_len] + lens.long().tolist()


def step_seconds(model: Llama, batch) -> float:
    kw = {} if batch.cu_seqlens is None else dict(positions=batch.positions, cu_seqlens=batch.cu_seqlens,
                                                   max_seqlen=batch.max_seqlen)
    t0 = time.perf_counter()
    packed_loss(model(batch.tokens, **kw), batch).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def compare(name: str, lengths: list[int], row_len: int, steps: int, seed: int) -> dict:
    torch.manual_seed(seed)
    model = Llama(LlamaConfig(**MODEL, max_seq_len=row_len))
    samples = make_samples(lengths, MODEL["vocab_size"], seed)
    real = sum(lengths)
    out = {"mix": name, "samples": len(lengths), "real_tokens": real, "row_len": row_len,
           "len_min": min(lengths), "len_median": sorted(lengths)[len(lengths) // 2], "len_max": max(lengths)}
    batches = {"packed": pack_samples(samples, row_len), "padded": pad_batch(samples, row_len)}
    times = {kind: [] for kind in batches}
    # Steps alternate between the two batches and each keeps its median, so a load change on a
    # shared machine hits both sides alike; step 0 of each is a warm-up (allocator, first calls).
    for i in range(steps + 1):
        for kind, batch in batches.items():
            dt = step_seconds(model, batch)
            if i:
                times[kind].append(dt)
    for kind, batch in batches.items():
        assert batch.num_skipped == 0 and int((batch.sample_index >= 0).sum()) == real
        dt = sorted(times[kind])[len(times[kind]) // 2]
        out[kind] = {"shape": list(batch.tokens.shape), "pad_fraction": batch.pad_fraction, "step_s": dt,
                     "tokens_per_s": real / dt}
    out["ratio"] = out["packed"]["tokens_per_s"] / out["padded"]["tokens_per_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="timed steps per batch (after one warm-up)")
    p.add_argument("--samples", type=int, default=48, help="samples per batch")
    p.add_argument("--row-len", type=int, default=512, help="packed row length (and the longest sample)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "packing.json"))
    args = p.parse_args()
    n, row = args.samples, args.row_len
    print(f"threads {torch.get_num_threads()}, Llama {MODEL}, fp32, {n} samples, rows of {row}")
    rows = [compare("skewed", skewed_lengths(n, row, args.seed), row, args.steps, args.seed),
            compare("equal", [row // 4] * n, row, args.steps, args.seed)]
    print(f"{'mix':7} {'lengths min/med/max':>20} {'batch':>10} {'pad':>6} {'step s':>7} {'tokens/s':>9}   "
          f"{'batch':>10} {'pad':>6} {'step s':>7} {'tokens/s':>9} {'packed/padded':>14}")
    print(f"{'':7} {'':>20} {'--- packed':>10} {'':>24}   {'--- padded':>10}")
    for r in rows:
        cells = []
        for kind in ("packed", "padded"):
            k = r[kind]
            cells.append(f"{'x'.join(map(str, k['shape'])):>10} {k['pad_fraction']:6.1%} {k['step_s']:7.3f} "
                         f"{k['tokens_per_s']:9.0f}")
        lens = f"{r['len_min']}/{r['len_median']}/{r['len_max']}"
        print(f"{r['mix']:7} {lens:>20} {cells[0]}   {cells[1]} {r['ratio']:13.2f}x")
    eq = rows[1]
    if eq["padded"]["pad_fraction"] == 0:
        print(f"equal lengths: no padding to remove (pad fraction 0 both ways), so padding costs nothing and "
              f"packing cannot gain; it runs at {eq['ratio']:.2f}x, the cost of varlen attention's "
              f"per-sequence calls")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"threads": torch.get_num_threads(), "model": MODEL, "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
