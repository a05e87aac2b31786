"""How long a training step blocks for a checkpoint: synchronous vs asynchronous saves.

A stack of linears with AdamW (params + two moments in fp32 = 12 bytes a parameter on disk) is
trained in one process; CheckpointManager (common/checkpoint.py) saves it every --every steps,
once with synchronous and once with asynchronous saves (train.ckpt_async). For each mode it
prints the time save() blocked the step (median over the saves), the time until the checkpoint
was complete on disk, and the step time around it; then sync blocked / async blocked.

  python bench/ckpt_async.py [--params 50e6] [--saves 3] [--every 4] [--dir /tmp/ckpt_bench]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from common.checkpoint import CheckpointManager, latest_complete
from common.dist import DistInfo


def build(params: float, width: int) -> torch.nn.Module:
    depth = max(1, round(params / (width * width + width)))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])


def run(mode_async: bool, args, root: str) -> dict:
    torch.manual_seed(0)
    model = build(args.params, args.width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width)
    ckpt = CheckpointManager(root, keep_last=1, signature={"bench": 1},
                             info=DistInfo(0, 1, 0, torch.device("cpu")), async_save=mode_async)
    blocked, complete, steps = [], [], []
    for step in range(1, args.saves * args.every + 1):
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append(time.perf_counter() - t0)
        if step % args.every == 0:
            t0 = time.perf_counter()
            ckpt.save(step, model, opt, {}, {})
            blocked.append(time.perf_counter() - t0)
            if not mode_async:
                complete.append(ckpt.last_write_s)
    ckpt.wait()
    if mode_async:  # complete times of async saves: the last one's (earlier ones overlap steps)
        complete.append(ckpt.last_write_s)
    assert latest_complete(root).endswith(f"step_{args.saves * args.every:08d}")
    return {"blocked_s": statistics.median(blocked), "complete_s": statistics.median(complete),
            "step_s": statistics.median(steps), "n_params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=50e6, help="model parameters (default 50e6: 600 MB per checkpoint)")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--every", type=int, default=4, help="steps between saves")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    args = p.parse_args()
    base = args.dir or tempfile.mkdtemp(prefix="ckpt_bench_")
    results = {}
    try:
        for name, is_async in (("sync", False), ("async", True)):
            results[name] = run(is_async, args, os.path.join(base, name))
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    n = results["sync"]["n_params"]
    print(f"model {n / 1e6:.1f}M params, checkpoint ~{n * 12 / 1e9:.2f} GB (weights + AdamW moments, fp32), "
          f"{torch.get_num_threads()} threads")
    for name, r in results.items():
        print(f"{name:5s}: step blocked {r['blocked_s']:.3f} s per save, checkpoint complete after "
              f"{r['complete_s']:.3f} s, training step {r['step_s']:.3f} s")
    print(f"blocking ratio sync / async: {results['sync']['blocked_s'] / results['async']['blocked_s']:.1f}x")


if __name__ == "__main__":
    main()
