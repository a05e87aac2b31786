"""Activation checkpointing modes on the text2image DiT: memory held for backward, peak memory
of a training step, and step time, each against no checkpointing.

  python bench/activation_memory.py [--hidden 384 --depth 12 --heads 6 --batch 8 --img-size 32
                                     --patch-size 2 --modes none,full,selective,offload --every 2]

Defaults are DiT-S width/depth on 32x32x4 latents with patch 2 (256 tokens), batch 8. One
training step = forward + MSE loss + backward + AdamW step (optimizer state already allocated).

Measures, per mode:
  saved      bytes forward holds for backward (SavedTensorMeter: distinct storages of saved
             tensors plus the block inputs checkpoint keeps, parameters excluded); offloaded
             bytes are reported separately (host).
  peak       peak allocated memory during one step above the level before it. CUDA:
             torch.cuda.max_memory_allocated. CPU: there is no allocator counter, so the step runs
             under torch.profiler(profile_memory=True), whose allocation events carry the running
             total of bytes allocated through torch's CPU allocator; the peak of that total is
             taken. Memory that oneDNN/MKL allocate internally is not seen.
  step time  median of --steps timed steps after --warmup, without profiler or meter: wall
             time, and on CPU also the process CPU time, which other jobs sharing the cores
             barely disturb (run with --threads 1 on a busy machine; the ratio uses it).
Data are random tensors made in memory; the text tower is left out (context is random).
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

from common.parallel.activation_checkpoint import MODES, SavedTensorMeter, apply_activation_checkpointing  # noqa: E402
from pipelines.text2image.model import DiT, dit_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_model(args) -> DiT:
    torch.manual_seed(0)
    cfg = dit_config("S", hidden=args.hidden, depth=args.depth, heads=args.heads, img_size=args.img_size,
                     patch_size=args.patch_size, in_channels=args.in_channels, text_dim=args.text_dim)
    return DiT(cfg)


def make_batch(args, device):
    g = torch.Generator().manual_seed(1)
    s, b = args.img_size, args.batch
    x = torch.randn(b, args.in_channels, s, s, generator=g)
    t = torch.rand(b, generator=g)
    ctx = torch.randn(b, args.text_len, args.text_dim, generator=g)
    mask = torch.ones(b, args.text_len, dtype=torch.bool)
    mask[:, args.text_len // 2:] = False  # padded captions, as the text tower gives
    target = torch.randn(b, args.in_channels, s, s, generator=g)
    return tuple(v.to(device) for v in (x, t, ctx, mask, target))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_step_bytes(step, device) -> int:
    """Peak allocated bytes during step() above the allocated level before it."""
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        sync(device)
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    mem = sorted((e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0),
                 key=lambda e: e["ts"])
    if not mem:
        return 0
    # The running total counts every allocation the reporter has seen in this process; the level
    # before the step is the first event's total minus its own size.
    base = mem[0]["args"]["Total Allocated"] - mem[0]["args"]["Bytes"]
    return max(e["args"]["Total Allocated"] for e in mem) - base


def bench_mode(base_model: DiT, mode: str, args, device) -> dict:
    model = copy.deepcopy(base_model).to(device)
    apply_activation_checkpointing(model.blocks, mode, args.every if mode == "selective" else 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, t, ctx, mask, target = make_batch(args, device)
    losses = []

    def forward():
        return ((model(x, t, ctx, mask) - target) ** 2).mean()

    def step(meter: SavedTensorMeter | None = None):
        if meter is not None:
            with meter:
                loss = forward()
        else:
            loss = forward()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    for _ in range(args.warmup):  # allocates AdamW state, first-call overheads
        step()
    meter = SavedTensorMeter(model)
    step(meter)
    peak = peak_step_bytes(step, device)
    times, cpu_times = [], []
    for _ in range(args.steps):
        sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    return {"mode": mode, "every": args.every if mode == "selective" else None,
            "saved_bytes": meter.device_bytes, "offloaded_bytes": meter.host_bytes, "peak_step_bytes": peak,
            "step_s": statistics.median(times), "step_s_all": times, "cpu_s": statistics.median(cpu_times),
            "cpu_s_all": cpu_times, "first_loss": losses[0]}


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
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--every", type=int, default=2, help="selective: checkpoint every k-th block")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave default)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--json", default=os.path.join(ROOT, "bench/results/activation_memory.json"))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"unknown modes {bad}; choose from {', '.join(MODES)}")

    base = build_model(args)
    tokens = (args.img_size // args.patch_size) ** 2
    print(f"DiT hidden={args.hidden} depth={args.depth} heads={args.heads}, batch {args.batch} x {tokens} tokens, "
          f"{sum(p.numel() for p in base.parameters()) / 1e6:.1f}M params, {device}, "
          f"{torch.get_num_threads()} threads, load avg {os.getloadavg()[0]:.1f}")
    rows = []
    for mode in modes:
        rows.append(bench_mode(base, mode, args, device))
        r = rows[-1]
        print(f"  {mode:9s} saved {r['saved_bytes'] / 2**20:8.1f} MiB  peak {r['peak_step_bytes'] / 2**20:8.1f} MiB  "
              f"step {r['step_s']:.3f} s (cpu {r['cpu_s']:.3f} s)", flush=True)
    ref = next((r for r in rows if r["mode"] == "none"), None)
    if ref is not None:
        for r in rows:
            r["saved_ratio"] = r["saved_bytes"] / ref["saved_bytes"]
            r["peak_ratio"] = r["peak_step_bytes"] / ref["peak_step_bytes"] if ref["peak_step_bytes"] else None
            r["time_ratio"] = r["step_s"] / ref["step_s"]
            r["cpu_ratio"] = r["cpu_s"] / ref["cpu_s"]
            # Same seed, same batch: every mode must reproduce the reference loss.
            r["loss_matches_none"] = r["first_loss"] == ref["first_loss"]

    hdr = f"{'mode':14s} {'saved MiB':>10s} {'x none':>7s} {'offl MiB':>9s} {'peak MiB':>9s} {'x none':>7s} {'wall s':>7s} {'x none':>7s} {'cpu s':>7s} {'x none':>7s}"
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for r in rows:
        name = r["mode"] + (f"(k={r['every']})" if r["every"] else "")
        ratio = (lambda k: f"{r[k]:7.2f}" if r.get(k) is not None else f"{'-':>7s}")
        print(f"{name:14s} {r['saved_bytes'] / 2**20:10.1f} {ratio('saved_ratio')} {r['offloaded_bytes'] / 2**20:9.1f} "
              f"{r['peak_step_bytes'] / 2**20:9.1f} {ratio('peak_ratio')} {r['step_s']:7.3f} {ratio('time_ratio')} "
              f"{r['cpu_s']:7.3f} {ratio('cpu_ratio')}")

    out = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "tokens": tokens, "device": str(device),
           "threads": torch.get_num_threads(), "torch": torch.__version__, "load_avg_1m": os.getloadavg()[0],
           "peak_method": "torch.cuda.max_memory_allocated" if device.type == "cuda" else
           "torch.profiler profile_memory: max of the CPU allocator's running total during the step",
           "results": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
