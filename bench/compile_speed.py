"""Eager vs per-block torch.compile (common.parallel.compile.compile_blocks) on the text2image
DiT: training-step throughput on this machine, compile time reported separately.

  python bench/compile_speed.py [--hidden 384 --depth 12 --heads 6 --batch 8 --steps 5 --no-mask-too]

One training step = forward + MSE loss + backward + AdamW step, on random in-memory tensors
(no text tower, no data loading). Compile time = first compiled step - median compiled step
(the first step traces, compiles forward and backward, then runs). Besides wall time, each step's
process CPU time is recorded: on a machine shared with other jobs (run with --threads 1) it is the
steadier measure, and samples/s is given for both. Inductor compiles in worker processes too, so
the CPU time of a compile counts children (os.times). Inductor's on-disk cache is
pointed at a fresh temporary directory unless --warm-cache, so the compile time is a cold one.
--no-mask-too adds a pair of rows without the text padding mask (the cross-attention's mask
branch is the one graph break in a DiT block at the time of writing).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.parallel.activation_checkpoint import MODES, apply_activation_checkpointing  # noqa: E402
from common.parallel.compile import compile_blocks  # noqa: E402
from pipelines.text2image.model import DiT, dit_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(base: DiT, args, compiled: bool, use_mask: bool) -> dict:
    import torch._dynamo
    torch._dynamo.reset()  # no graphs carried over from a previous variant
    from torch._dynamo.utils import counters
    counters.clear()
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model.blocks, args.ac)
    if compiled:
        compile_blocks(model.blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    s, b = args.img_size, args.batch
    x, t = torch.randn(b, args.in_channels, s, s, generator=g), torch.rand(b, generator=g)
    ctx = torch.randn(b, args.text_len, args.text_dim, generator=g)
    mask = torch.ones(b, args.text_len, dtype=torch.bool)
    mask[:, args.text_len // 2:] = False
    target = torch.randn(b, args.in_channels, s, s, generator=g)

    def cpu() -> float:
        tm = os.times()
        return tm.user + tm.system + tm.children_user + tm.children_system

    def step() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), cpu()
        loss = ((model(x, t, ctx, mask if use_mask else None) - target) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step.losses.append(loss.item())
        return time.perf_counter() - t0, cpu() - c0

    step.losses = []
    first, first_cpu = step()
    for _ in range(args.warmup):
        step()
    times, cpu_times = zip(*[step() for _ in range(args.steps)])
    med, med_cpu = statistics.median(times), statistics.median(cpu_times)
    name = ("compiled" if compiled else "eager") + ("" if use_mask else " (no mask)")
    return {"name": name, "compiled": compiled, "mask": use_mask, "first_step_s": first,
            "compile_s": first - med if compiled else None,
            "compile_cpu_s": first_cpu - med_cpu if compiled else None,
            "step_s": med, "step_s_all": list(times), "cpu_s": med_cpu, "cpu_s_all": list(cpu_times),
            "samples_per_s": b / med, "samples_per_cpu_s": b / med_cpu, "first_loss": step.losses[0],
            "graphs": counters["stats"]["unique_graphs"] if compiled else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--img-size", type=int, default=32)
    p.add_argument("--patch-size", type=int, default=2)
    p.add_argument("--in-channels", type=int, default=4)
    p.add_argument("--text-len", type=int, default=32)
    p.add_argument("--text-dim", type=int, default=512)
    p.add_argument("--ac", default="none", choices=MODES, help="activation checkpointing under both variants")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave default)")
    p.add_argument("--no-mask-too", action="store_true", help="also run both variants without the text mask")
    p.add_argument("--warm-cache", action="store_true", help="keep inductor's on-disk cache (compile time not cold)")
    p.add_argument("--json", default=os.path.join(ROOT, "bench/results/compile_speed.json"))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = None
    if not args.warm_cache:
        tmp = tempfile.TemporaryDirectory(prefix="inductor_cache_")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tmp.name  # read when inductor first compiles

    torch.manual_seed(0)
    base = DiT(dit_config("S", hidden=args.hidden, depth=args.depth, heads=args.heads, img_size=args.img_size,
                          patch_size=args.patch_size, in_channels=args.in_channels, text_dim=args.text_dim))
    tokens = (args.img_size // args.patch_size) ** 2
    print(f"DiT hidden={args.hidden} depth={args.depth} heads={args.heads}, batch {args.batch} x {tokens} tokens, "
          f"AC {args.ac}, {torch.get_num_threads()} threads, load avg {os.getloadavg()[0]:.1f}", flush=True)
    variants = [(False, True), (True, True)] + ([(False, False), (True, False)] if args.no_mask_too else [])
    rows = []
    for compiled, use_mask in variants:
        rows.append(run(base, args, compiled, use_mask))
        r = rows[-1]
        print(f"  {r['name']:22s} step {r['step_s']:.3f} s (cpu {r['cpu_s']:.3f} s)  first {r['first_step_s']:.1f} s", flush=True)
    for r in rows:
        eager = next(e for e in rows if not e["compiled"] and e["mask"] == r["mask"])
        r["speedup"] = eager["step_s"] / r["step_s"]
        r["speedup_cpu"] = eager["cpu_s"] / r["cpu_s"]
        r["loss_rel_diff_vs_eager"] = abs(r["first_loss"] - eager["first_loss"]) / abs(eager["first_loss"])

    hdr = (f"{'variant':22s} {'samples/s':>10s} {'step s':>8s} {'speedup':>8s} {'smp/cpu-s':>10s} {'cpu s':>7s} "
           f"{'speedup':>8s} {'compile s':>10s} {'(cpu s)':>8s} {'graphs':>7s}")
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for r in rows:
        comp = (f"{r['compile_s']:10.1f} {r['compile_cpu_s']:8.1f}" if r["compile_s"] is not None
                else f"{'-':>10s} {'-':>8s}")
        graphs = f"{r['graphs']:7d}" if r["graphs"] is not None else f"{'-':>7s}"
        print(f"{r['name']:22s} {r['samples_per_s']:10.2f} {r['step_s']:8.3f} {r['speedup']:8.2f} "
              f"{r['samples_per_cpu_s']:10.2f} {r['cpu_s']:7.3f} {r['speedup_cpu']:8.2f} {comp} {graphs}")

    out = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "tokens": tokens,
           "threads": torch.get_num_threads(), "torch": torch.__version__, "load_avg_1m": os.getloadavg()[0],
           "results": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    print(f"\nwrote {args.json}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
