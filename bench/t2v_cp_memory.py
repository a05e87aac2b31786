"""Per-rank memory of one text2video training step against clip length, for context parallelism
CP = 1, 2, 4, with and without activation checkpointing.

  python bench/t2v_cp_memory.py [--frames 8,16,32,64 --cp 1,2,4 --ac none,full --cp-mode ulysses
                                 --hidden 256 --depth 4 --heads 8 --img-size 32 --patch-size 4
                                 --temporal-patch 2 --batch 1 --threads 1 --json OUT]

Defaults: VideoDiT width 256 / depth 4 / 8 heads (head dim 32), 3-channel 32x32 pixel frames,
patches 2 x 4 x 4, so a frame pair is 64 tokens and 8..64 frames are 256..2048 tokens.

Per CP degree the script spawns `cp` processes with a gloo group (world size = cp, layout: cp
only) that run all (frames, ac) cases in turn, each on a freshly built model (peaks are taken
relative to the level before each step, so earlier cases do not leak into later ones). Every rank builds the same seeded model and gets the same batch (CP ranks share one data
rank, as the dp_cp layout of the loader gives them), and the model is parallelised the way
common.nn.dit_parallel.parallelize_dit does it: ParallelDims.from_config + the layout and model
checks, build_mesh, apply_context_parallel (tokens and RoPE rows sharded at the
first block, gathered before the final layer), apply_block_options (activation checkpointing).
The one step left out by default is the data-parallel wrap: with cp > 1 the pipeline only
accepts dp_mode fsdp (dp_mode=none is refused because CP ranks must average their gradients),
and FSDP would shard parameters, gradients and add all-gather buffers, so the difference between
CP degrees would no longer be the activations alone. Default `--dp-mode replicated` therefore
keeps parameters replicated and skips the gradient reduction (not needed to measure memory; the
local gradients have the right size, and the loss is exact). `--dp-mode fsdp` calls the
pipeline's parallelize() unchanged instead (FSDP2 over the CP ranks).

One step = forward + MSE loss + backward (zero_grad runs just before it, outside the measurement). No optimizer: its state and
update are replicated and the same for every CP degree, so they would only add a constant;
gradients ARE allocated inside the step (set to None before it), as in a real training step.
Per case, after one warm-up step:
  saved    bytes the forward holds for backward (common.parallel.activation_checkpoint.
           SavedTensorMeter: distinct storages, parameters excluded; under AC the block inputs
           checkpoint keeps). Split into the part saved inside the DiT blocks (sharded by CP) and
           outside (patch embedding, timestep/text conditioning and the final layer, loss and
           unpatchify on the gathered sequence: not sharded).
  step pk  peak bytes allocated through torch's CPU allocator during the step above the level
           before it, from torch.profiler(profile_memory=True) allocation events (the method of
           bench/activation_memory.py, function peak_step_bytes). Gradients are set to None
           before the step, so this includes allocating them (= parameter bytes, replicated).
  act pk   the same peak with the gradients already allocated (zeroed before the step, backward
           accumulates into them): activations plus transient buffers (attention workspaces,
           all-to-all / all-gather buffers), i.e. the part context parallelism can shard.
Peaks are the median of --repeats profiled steps. Blocking gloo collectives are made to free
their buffers before returning (--comm-free prompt, see prompt_comm_frees), which makes the peaks
reproducible to the byte. All are reported as the max over ranks. The expectation printed next to them:
  saved(cp) ~ other(1) + blocks(1) / cp     and    act_pk(cp) ~ other(1) + (act_pk(1) - other(1)) / cp
(everything but the unsharded embed/final/loss part shards: what the blocks save, and the
transients at the peak, which are the recompute of one block under AC and per-block workspaces
without it). Deviations are what the CP implementation adds per rank: the text K/V of
cross-attention (replicated), one more token-sized buffer per block kept by autograd on the
Ulysses path, the all-gathered final-layer input, communication buffers.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import queue as queue_mod
import socket
import statistics
import sys
import time
import traceback
from contextlib import nullcontext

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.cpu_memory import SplitMeter, measured_peaks, prompt_comm_frees  # noqa: E402

MiB = 2 ** 20


def build_model(args, frames: int):
    from pipelines.text2video.model import VideoDiT, video_dit_config
    cfg = video_dit_config("tiny", frames=frames, height=args.img_size, width=args.img_size,
                           in_channels=args.in_channels, patch_size=args.patch_size,
                           temporal_patch=args.temporal_patch, hidden=args.hidden, depth=args.depth,
                           heads=args.heads, text_dim=args.text_dim, text_len=args.text_len, attention="full")
    torch.manual_seed(0)
    model = VideoDiT(cfg)
    # The DiT init zeroes the final layer and the adaLN gates (the output is 0 whatever the
    # input); perturb every weight so the loss depends on the whole network and can be compared
    # across CP degrees. Same seed on every rank: parameters are replicated.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g), alpha=0.02)
    return model


def make_batch(args, frames: int):
    """Identical on every CP rank (one data-parallel rank)."""
    g = torch.Generator().manual_seed(2)
    b, c, s = args.batch, args.in_channels, args.img_size
    x = torch.randn(b, c, frames, s, s, generator=g)
    t = torch.rand(b, generator=g)
    ctx = torch.randn(b, args.text_len, args.text_dim, generator=g)
    mask = torch.ones(b, args.text_len, dtype=torch.bool)
    mask[:, args.text_len // 2:] = False  # padded captions
    target = torch.randn(b, c, frames, s, s, generator=g)
    return x, t, ctx, mask, target


def parallelize_replicated(model, pcfg, info, mesh_cache: dict):
    """common.nn.dit_parallel.parallelize_dit without its data-parallel wrap (see the module
    doc); the mesh is built once per process and reused across cases."""
    from common.nn.dit_parallel import apply_block_options, apply_context_parallel
    from common.parallel.dims import ParallelDims
    from common.parallel.layouts import check_layout
    dims = ParallelDims.from_config(pcfg, info.world_size)
    mc = model.cfg
    check_layout(dims, pcfg, model.parallel_limits(), "text2video")
    dims.check_model(heads=mc.heads, seq_len=mc.num_tokens, layers=mc.depth, microbatches=1)
    if "mesh" not in mesh_cache:
        mesh_cache["mesh"] = dims.build_mesh(info.device.type)
    if dims.cp > 1:
        apply_context_parallel(model, mesh_cache["mesh"], dims, mc.num_tokens)
    apply_block_options(model.blocks, pcfg)
    return model, dims


def run_case(args, frames: int, ac: str, info, mesh_cache: dict) -> dict:
    from common.config import ParallelConfig
    cp = info.world_size
    model = build_model(args, frames)
    n_params = sum(p.numel() * p.element_size() for p in model.parameters())
    pcfg = ParallelConfig(cp=cp, cp_mode=args.cp_mode, cp_ulysses=args.cp_ulysses, activation_checkpoint=ac,
                          ac_every=args.ac_every, dp_mode="auto")
    if args.dp_mode == "fsdp" and cp > 1:
        from common.nn.dit_parallel import parallelize_dit
        pm = parallelize_dit(model, pcfg, info, name="text2video")
        module, dims = pm.module, pm.dims
    else:
        module, dims = parallelize_replicated(model, pcfg, info, mesh_cache)
    x, t, ctx, mask, target = make_batch(args, frames)
    losses = []
    # A fixed random projection of the output: its change against cp=1 is a sensitive check that
    # the sharded computation is the same function (the loss alone hardly moves, the DiT's
    # adaLN gates start near zero).
    weights = torch.randn(target.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    digest = [0.0, 0.0]

    def step(meter=None):
        with meter if meter is not None else nullcontext():
            out = module(x, t, ctx, mask)
            loss = ((out - target) ** 2).mean()
        loss.backward()
        losses.append(loss.item())
        digest[:] = [float((out.detach().double() * weights).sum()), float(out.detach().double().abs().sum())]

    # zero_grad runs before each step, outside the profiled region: with set_to_none the level
    # before the step holds no gradients (the trainer's zero_grad(set_to_none=True)), so the peak
    # includes allocating them; with zeros the gradients are part of the level before the step
    # and backward accumulates into them, so the peak is the activations and transients alone.
    module.zero_grad(set_to_none=True)
    step()  # warm-up: first-call overheads, cached RoPE / ring geometry
    module.zero_grad(set_to_none=True)
    meter = SplitMeter(model)
    step(meter)
    meter.remove()
    t0 = time.perf_counter()
    peaks = measured_peaks(step, lambda: module.zero_grad(set_to_none=True), args.repeats)
    dt = (time.perf_counter() - t0) / args.repeats
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in module.parameters() if p.grad is not None)
    act_peaks = measured_peaks(step, lambda: module.zero_grad(set_to_none=False), args.repeats)
    peak, act_peak = statistics.median(peaks), statistics.median(act_peaks)
    return {"frames": frames, "tokens": model.cfg.num_tokens, "cp": cp, "ac": ac, "rank": info.rank,
            "dp_mode": dims.dp_mode if args.dp_mode == "fsdp" else "replicated",
            "saved_bytes": meter.device_bytes + meter.host_bytes, "saved_in_blocks_bytes": meter.in_block_bytes,
            "peak_step_bytes": peak, "act_peak_bytes": act_peak, "peak_step_bytes_all": peaks,
            "act_peak_bytes_all": act_peaks, "param_bytes": n_params, "grad_bytes": grad_bytes,
            "loss": losses[-1], "out_digest": digest[0], "out_abs_sum": digest[1], "losses_equal": len(set(losses)) == 1, "profiled_step_s": dt}


# ----------------------------------------------------------------------------- processes
def _worker(rank: int, world_size: int, port: int, args, cases, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS=str(args.threads))
    import torch.distributed as dist

    from common.dist import DistInfo
    torch.set_num_threads(args.threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        info = DistInfo(rank, world_size, rank, torch.device("cpu"))
        if args.comm_free == "prompt":
            prompt_comm_frees()
        mesh_cache: dict = {}
        for frames, ac in cases:
            queue.put((rank, "row", run_case(args, frames, ac, info, mesh_cache)))
            gc.collect()  # the case's model sits in reference cycles (hooks, AC wrappers)
        queue.put((rank, "done", None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(args, cp: int, cases, on_case) -> None:
    """Spawn cp ranks that run `cases` in order; on_case(list of per-rank rows) per finished case."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, cp, port, args, cases, queue)) for r in range(cp)]
    for p in procs:
        p.start()
    pending: dict[int, list] = {}
    done = 0
    try:
        waited = 0.0
        while done < cp:
            try:
                rank, kind, value = queue.get(timeout=5.0)
            except queue_mod.Empty:
                waited += 5.0
                dead = [i for i, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)]
                if dead or waited >= args.timeout:
                    raise RuntimeError(f"cp={cp}: " + (f"rank(s) {dead} died (exit codes "
                                       f"{[procs[i].exitcode for i in dead]})" if dead else
                                       f"no result for {args.timeout:.0f} s")) from None
                continue
            waited = 0.0
            if kind == "error":
                raise RuntimeError(f"cp={cp} rank {rank} failed:\n{value}")
            if kind == "done":
                done += 1
                continue
            key = (value["frames"], value["ac"])
            pending.setdefault(key, []).append(value)
            if len(pending[key]) == cp:
                on_case(sorted(pending.pop(key), key=lambda r: r["rank"]))
    finally:
        for p in procs:
            p.join(timeout=5 if done == cp else 0.5)
            if p.is_alive():
                p.kill()


# ----------------------------------------------------------------------------- report
def merge(rows: list[dict]) -> dict:
    """Per-rank rows of one case -> one row, memory as the max over ranks."""
    r0 = rows[0]
    out = {k: r0[k] for k in ("frames", "tokens", "cp", "ac", "dp_mode", "param_bytes")}
    for k in ("saved_bytes", "saved_in_blocks_bytes", "peak_step_bytes", "act_peak_bytes", "grad_bytes"):
        out[k] = max(r[k] for r in rows)
        out[k + "_per_rank"] = [r[k] for r in rows]
    for k in ("peak_step_bytes_all", "act_peak_bytes_all"):
        out[k + "_per_rank"] = [r[k] for r in rows]
    out["loss"], out["out_digest"], out["out_abs_sum"] = r0["loss"], r0["out_digest"], r0["out_abs_sum"]
    out["loss_same_on_ranks"] = all(r["loss"] == r0["loss"] for r in rows)
    out["losses_equal_across_steps"] = all(r["losses_equal"] for r in rows)
    out["profiled_step_s"] = max(r["profiled_step_s"] for r in rows)
    return out


def add_expectations(results: list[dict]) -> None:
    ref = {(r["frames"], r["ac"]): r for r in results if r["cp"] == 1}
    for r in results:
        base = ref.get((r["frames"], r["ac"]))
        if base is None:
            continue
        cp, inside = r["cp"], base["saved_in_blocks_bytes"]
        outside = base["saved_bytes"] - inside
        ratio = (lambda a, b: a / b if b else None)
        r["saved_ratio"] = ratio(r["saved_bytes"], base["saved_bytes"])
        r["peak_ratio"] = ratio(r["peak_step_bytes"], base["peak_step_bytes"])
        r["act_peak_ratio"] = ratio(r["act_peak_bytes"], base["act_peak_bytes"])
        r["expected_saved_bytes"] = outside + inside / cp
        r["expected_saved_ratio"] = ratio(r["expected_saved_bytes"], base["saved_bytes"])
        r["expected_act_peak_bytes"] = outside + (base["act_peak_bytes"] - outside) / cp
        r["expected_act_peak_ratio"] = ratio(r["expected_act_peak_bytes"], base["act_peak_bytes"])
        r["loss_rel_diff_vs_cp1"] = abs(r["loss"] - base["loss"]) / abs(base["loss"])
        r["out_rel_diff_vs_cp1"] = abs(r["out_digest"] - base["out_digest"]) / base["out_abs_sum"]


def format_table(results: list[dict]) -> str:
    hdr = (f"{'frames':>6s} {'tokens':>6s} {'cp':>3s} {'ac':>5s} | {'step pk':>8s} {'x cp1':>6s} | {'act pk':>8s} "
           f"{'x cp1':>6s} {'exp':>6s} | {'saved':>8s} {'blocks':>8s} {'other':>6s} {'x cp1':>6s} {'exp':>6s} | "
           f"{'1/cp':>5s} {'out dev':>8s}")
    lines = [hdr, "-" * len(hdr)]
    f = (lambda v, w=6: f"{v:{w}.3f}" if v is not None else f"{'-':>{w}s}")
    prev = None
    for r in results:
        if prev is not None and (r["ac"], r["frames"]) != prev:
            lines.append("")
        prev = (r["ac"], r["frames"])
        s, sb = r["saved_bytes"], r["saved_in_blocks_bytes"]
        lines.append(f"{r['frames']:6d} {r['tokens']:6d} {r['cp']:3d} {r['ac']:>5s} | {r['peak_step_bytes'] / MiB:8.2f} "
                     f"{f(r.get('peak_ratio'))} | {r['act_peak_bytes'] / MiB:8.2f} {f(r.get('act_peak_ratio'))} "
                     f"{f(r.get('expected_act_peak_ratio'))} | {s / MiB:8.2f} {sb / MiB:8.2f} {(s - sb) / MiB:6.2f} "
                     f"{f(r.get('saved_ratio'))} {f(r.get('expected_saved_ratio'))} | "
                     f"{1 / r['cp']:5.3f} {r.get('out_rel_diff_vs_cp1', float('nan')):8.1e}")
    return "\n".join(lines)


def sanity_lines(results: list[dict]) -> list[str]:
    out = []
    for ac in sorted({r["ac"] for r in results}):
        ref = sorted((r for r in results if r["cp"] == 1 and r["ac"] == ac), key=lambda r: r["frames"])
        if len(ref) >= 2:
            per = ", ".join(f"{r['frames']}f {r['saved_bytes'] / r['frames'] / 1024:.0f}/"
                            f"{r['act_peak_bytes'] / r['frames'] / 1024:.0f}" for r in ref)
            out.append(f"linearity cp=1 ac={ac}: saved / act peak, KiB per frame: {per}")
        for r in ref:
            if ac == "none":
                est = r["saved_bytes"] + r["grad_bytes"]
                out.append(f"cp=1 ac=none {r['frames']}f: step peak {r['peak_step_bytes'] / MiB:.2f} MiB vs saved + "
                           f"grads {est / MiB:.2f} MiB (x{r['peak_step_bytes'] / est:.2f}); act peak "
                           f"{r['act_peak_bytes'] / MiB:.2f} MiB vs saved {r['saved_bytes'] / MiB:.2f} MiB "
                           f"(x{r['act_peak_bytes'] / r['saved_bytes']:.2f})")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frames", default="8,16,32,64",
                   help="pixel-space clip lengths (comma list); tokens = ceil(frames / temporal_patch) * "
                        "(img_size / patch_size)^2 and must divide by every cp")
    p.add_argument("--cp", default="1,2,4", help="context-parallel degrees = processes per run (comma list); "
                   "cp=1 is the reference for the ratios")
    p.add_argument("--ac", default="none,full", help="activation checkpointing modes (none | full | selective | offload)")
    p.add_argument("--ac-every", type=int, default=2, help="selective AC: every k-th block")
    p.add_argument("--cp-mode", default="ulysses", choices=("ulysses", "ring", "hybrid"),
                   help="ContextParallel mode (ulysses needs heads divisible by cp; hybrid needs cp = "
                        "cp_ulysses x ring, both >= 2)")
    p.add_argument("--cp-ulysses", type=int, default=2, help="hybrid: Ulysses degree")
    p.add_argument("--dp-mode", default="replicated", choices=("replicated", "fsdp"),
                   help="replicated: pipeline parallelize() minus the data-parallel wrap (parameters replicated, "
                        "only activations differ); fsdp: the pipeline's parallelize() as is")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--img-size", type=int, default=32, help="frame height = width (pixels)")
    p.add_argument("--patch-size", type=int, default=4, help="spatial patch")
    p.add_argument("--temporal-patch", type=int, default=2)
    p.add_argument("--in-channels", type=int, default=3)
    p.add_argument("--text-len", type=int, default=32)
    p.add_argument("--text-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--comm-free", default="prompt", choices=("prompt", "as-is"),
                   help="prompt: blocking gloo collectives return only after the worker thread released "
                        "their buffers (deterministic peaks, see prompt_comm_frees); as-is: leave gloo alone")
    p.add_argument("--repeats", type=int, default=3, help="profiled steps per peak measurement (median reported)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the next case before giving up")
    p.add_argument("--json", default=os.path.join(ROOT, "bench/results/t2v_cp_memory.json"))
    p.add_argument("--table", default=os.path.join(ROOT, "bench/results/t2v_cp_memory.txt"),
                   help="also write the printed report here ('' to skip)")
    args = p.parse_args()
    frames = [int(v) for v in args.frames.split(",")]
    cps = [int(v) for v in args.cp.split(",")]
    acs = args.ac.split(",")
    from common.parallel.activation_checkpoint import MODES
    bad = [a for a in acs if a not in MODES]
    if bad:
        p.error(f"unknown --ac modes {bad}; choose from {', '.join(MODES)}")
    grid = lambda f: math.ceil(f / args.temporal_patch) * (args.img_size // args.patch_size) ** 2  # noqa: E731
    for f in frames:
        for cp in cps:
            if grid(f) % cp:
                p.error(f"--frames {f} gives {grid(f)} tokens, not divisible by cp={cp}")
    if args.cp_mode in ("ulysses",) and any(args.heads % cp for cp in cps):
        p.error(f"ulysses needs heads ({args.heads}) divisible by every cp {cps}")

    head = (f"VideoDiT hidden={args.hidden} depth={args.depth} heads={args.heads}, {args.img_size}x{args.img_size}x"
            f"{args.in_channels} frames, patch {args.temporal_patch}x{args.patch_size}x{args.patch_size}, batch "
            f"{args.batch}; cp_mode={args.cp_mode}, dp_mode={args.dp_mode}; {args.threads} thread(s)/rank, "
            f"torch {torch.__version__}, load avg {os.getloadavg()[0]:.1f}")
    print(head, flush=True)
    cases = [(f, ac) for ac in acs for f in frames]
    results = []
    t_start = time.perf_counter()

    def on_case(rows):
        r = merge(rows)
        results.append(r)
        print(f"  frames {r['frames']:3d} ({r['tokens']:5d} tokens) cp {r['cp']} ac {r['ac']:5s}: "
              f"peak {r['peak_step_bytes'] / MiB:8.2f} MiB/rank, saved {r['saved_bytes'] / MiB:8.2f} MiB/rank "
              f"(blocks {r['saved_in_blocks_bytes'] / MiB:.2f}), loss {r['loss']:.6f}  "
              f"[{time.perf_counter() - t_start:.0f} s]", flush=True)

    for cp in cps:
        run_group(args, cp, cases, on_case)
    wall = time.perf_counter() - t_start
    results.sort(key=lambda r: (acs.index(r["ac"]), r["frames"], r["cp"]))
    add_expectations(results)
    params = results[0]["param_bytes"]
    legend = [
        f"params {params / MiB:.2f} MiB " + ("(replicated: gradients per rank are the same size)" if args.dp_mode ==
                                             "replicated" else "(FSDP-sharded over the CP ranks when cp > 1: unsharded "
                                             "weights gathered for forward/backward count as saved and as peak)")
        + "; memory in MiB, max over ranks",
        "step pk: torch CPU allocator peak of fwd + loss + bwd above the level before it, gradients set to None "
        "before the step (as the trainer does), so it includes allocating them",
        "act pk:  the same with the gradients already allocated (zeroed): activations and transients only",
        "saved:   bytes held for backward; blocks = saved inside the DiT blocks (sharded by CP), other = patch "
        "embedding, conditioning, final layer, unpatchify and loss (full sequence on every rank)",
        "exp:     expectation from the cp=1 row: saved = other + blocks/cp; act pk = other + (act pk(1) - other)/cp",
        "out dev: |sum(w * out) - same at cp=1| / sum(|out(cp=1)|), w fixed random: same seeded model and batch, "
        "so only float summation order may differ",
    ]
    report = ([head] + legend + ["", format_table(results), ""] + sanity_lines(results)
              + [f"wall time {wall:.0f} s"])
    text = "\n".join(report)
    print("\n" + text)
    bad_loss = [r for r in results if not r["loss_same_on_ranks"] or r.get("loss_rel_diff_vs_cp1", 0) > 1e-4
                or r.get("out_rel_diff_vs_cp1", 0) > 1e-5]
    if bad_loss:
        print(f"WARNING: loss differs across ranks or from cp=1 in {len(bad_loss)} case(s)")
    out = {"config": {k: v for k, v in vars(args).items() if k not in ("json", "table")}, "wall_s": wall,
           "torch": torch.__version__, "load_avg_1m": os.getloadavg()[0],
           "peak_method": "torch.profiler profile_memory: max of the CPU allocator's running total during the step",
           "results": results}
    for path, content in ((args.json, json.dumps(out, indent=2)), (args.table, text + "\n")):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as fh:
                fh.write(content)
    print(f"\nwrote {args.json}" + (f" and {args.table}" if args.table else ""))


if __name__ == "__main__":
    main()
