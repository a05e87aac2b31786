"""text2image training-step throughput and CPU-MFU on this machine.

MFU here is achieved model FLOP/s (3 x forward FLOPs per sample x samples/s) over the FLOP/s of
a large fp32 matmul measured in the same process: the practical peak of these cores, so the
ratio says how much of the machine the model's small matmuls and glue leave unused.
Data loading is excluded (batches are made up in memory); the text tower's forward is included.

  python bench/t2i_cpu.py [--steps N] [--batch B] [--configs tiny,S] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.config import build_config  # noqa: E402
from common.metrics import measure_matmul_peak  # noqa: E402
from common.optim import build_optimizer  # noqa: E402
from pipelines.text2image import components  # noqa: E402
from pipelines.text2image.config import T2IConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {
    # The demo config as shipped.
    "tiny": ["model.preset=tiny"],
    # DiT-S width/depth (384 x 12, 6 heads) in pixel space at 32 px with patch 2: 256 tokens.
    "S": ["model.preset=S", "model.patch_size=2", "text.width=512", "text.layers=4", "text.heads=8"],
}


def bench(name: str, overrides: list[str], batch: int, steps: int, peak: float) -> dict:
    cfg = build_config(T2IConfig, os.path.join(ROOT, "pipelines/text2image/configs/tiny.yaml"), overrides)
    comp = components.build(cfg)
    model = comp.model
    prepare, criterion = components.make_step_fns(comp, torch.device("cpu"))
    opt = build_optimizer(model, cfg.optim)
    size = comp.latent_size
    captions = [f"a red circle on a black background {i}" for i in range(batch)]

    def step(i: int) -> None:
        batch_d = {"image": torch.rand(batch, 3, size, size) * 2 - 1, "caption": captions,
                   "__position__": torch.arange(i * batch, (i + 1) * batch)}
        inputs, target = prepare(batch_d)
        criterion(model(*inputs), target).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(2):  # warm-up: allocator, first-call overheads
        step(i)
    t0 = time.perf_counter()
    for i in range(steps):
        step(i + 2)
    dt = (time.perf_counter() - t0) / steps
    sps = batch / dt
    flops = model.flops_per_sample()
    achieved = 3.0 * flops * sps
    return {"config": name, "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
            "tokens": comp.num_tokens, "batch": batch, "step_s": dt, "samples_per_s": sps,
            "model_gflop_per_sample_train": 3.0 * flops / 1e9, "achieved_gflops": achieved / 1e9,
            "peak_gflops": peak / 1e9, "mfu": achieved / peak}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--configs", default="tiny,S")
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "t2i_cpu.json"))
    args = p.parse_args()
    torch.manual_seed(0)
    peak = measure_matmul_peak(torch.device("cpu"), torch.float32, n=2048, reps=5)
    print(f"threads {torch.get_num_threads()}, fp32 matmul peak {peak / 1e9:.1f} GFLOP/s (2048^3)")
    rows = [bench(name, CONFIGS[name], args.batch, args.steps, peak) for name in args.configs.split(",")]
    print(f"{'config':8} {'params':>8} {'tokens':>6} {'batch':>5} {'step s':>8} {'samples/s':>10} {'GFLOP/s':>8} {'MFU':>6}")
    for r in rows:
        print(f"{r['config']:8} {r['params_m']:7.2f}M {r['tokens']:6d} {r['batch']:5d} {r['step_s']:8.3f} "
              f"{r['samples_per_s']:10.1f} {r['achieved_gflops']:8.1f} {r['mfu']:6.1%}")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"peak_gflops": peak / 1e9, "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
