"""CPU attention time against the number of keys: why CrossAttention pads its keys to a multiple
of common.nn.attention.CPU_KEY_MULTIPLE on CPU.

ATen's CPU flash-attention kernel handles a key count that is not a multiple of its block
width in a slower tail path, so fewer keys can cost more time. For each query shape, each key
count n is timed (fp32 SDPA with a boolean key mask, forward + backward, best of --repeats) next
to n rounded up to the multiple (the extra keys masked, as CrossAttention adds them); the ratio
printed is ragged time / aligned time, > 1 means rounding up pays.

  python bench/cpu_attention_keys.py [--keys 5,9,24,31,40,77] [--threads 1] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.nn.attention import CPU_KEY_MULTIPLE  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (name, batch, heads, queries, head dim): the text2image demo's cross-attention and DiT-S's
SHAPES = (("demo", 32, 4, 64, 32), ("S", 32, 6, 256, 64))


def time_keys(batch: int, heads: int, queries: int, head_dim: int, keys: int, used: int,
              repeats: int, calls: int) -> float:
    """Best ms per forward + backward over `keys` key columns of which the first `used` are real."""
    q = torch.randn(batch, heads, queries, head_dim, requires_grad=True)
    k = torch.randn(batch, heads, keys, head_dim, requires_grad=True)
    v = torch.randn(batch, keys, heads, head_dim).transpose(1, 2).requires_grad_()  # as the layers' views
    mask = torch.zeros(batch, 1, 1, keys, dtype=torch.bool)
    mask[..., :used] = True
    grad = torch.randn(batch, heads, queries, head_dim)

    def step():
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask).backward(grad)

    return best_ms(step, repeats, calls)


def best_ms(step, repeats: int, calls: int, warmup: int = 1) -> float:
    """Best mean ms per call of `step` over `repeats` runs of `calls` calls, after `warmup` calls."""
    for _ in range(warmup):
        step()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", default="5,9,24,31,40,77", help="comma-separated key counts to time")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "cpu_attention_keys.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name, b, h, lq, d in SHAPES:
        calls = 10 if lq <= 64 else 2
        for n in (int(x) for x in args.keys.split(",")):
            aligned = -(-n // CPU_KEY_MULTIPLE) * CPU_KEY_MULTIPLE
            ragged_ms = time_keys(b, h, lq, d, n, n, args.repeats, calls)
            aligned_ms = time_keys(b, h, lq, d, aligned, n, args.repeats, calls)
            rows.append({"shape": name, "keys": n, "aligned_keys": aligned, "ragged_ms": ragged_ms,
                         "aligned_ms": aligned_ms, "ratio": ragged_ms / aligned_ms})
            print(f"{name:4} B{b} H{h} Lq{lq} D{d}: {n:3} keys {ragged_ms:7.2f} ms, padded to {aligned:3} "
                  f"{aligned_ms:7.2f} ms: ratio {ragged_ms / aligned_ms:.2f}x", flush=True)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"threads": args.threads, "multiple": CPU_KEY_MULTIPLE, "torch": torch.__version__,
                   "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
