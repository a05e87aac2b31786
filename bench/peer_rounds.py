"""Alternating-rounds timing of our training step against a peer library's, in one process.

Shared by bench/t2i_vs_diffusers.py and bench/t2v_vs_diffusers.py. A side is any object with
`batch` (samples per step) and `step()` (one full training step). Rounds alternate which side
goes first (ours in even rounds, the peer in odd ones), so that load from anything else on the
machine falls on both alike; the ratio is ours / peer in samples per second, the median over
rounds, beside the ratio of each side's best round (other load only ever slows a round, so on a
shared VM the best rounds are the steadier estimate when medians drift between runs) and the
quartiles of the rounds' own ratios (ours in a round over the peer's round beside it): the spread
that one run's ratio carries.

`--split` adds what bounds the ratio: both sides run the same ATen kernels for their matmuls,
attention and activations, at the same shapes where the dimensions match. Timing every ATen op
of a few steps per side (a dispatch-mode timer, eager only) gives each side's time in those
shared kernels and in everything else; the peer's step time over our shared-kernel time is the
ratio ours would reach if everything else of our step took no time at all, and the peer's step
time over the peer's shared-kernel time is the ratio if, besides, our shared kernels ran no
slower than the peer's. A target above both
cannot be reached by removing overhead, only with fewer FLOPs or faster kernels. Each side's
largest other ops are listed beside: where the rest of its step goes.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
CLOCK_HELP = ("wall: elapsed time (the default; what a user waits). cpu: this process's CPU time, which "
              "time stolen by other VMs does not inflate; with --threads 1 it is the work itself (with more "
              "threads it also counts OpenMP spin-waits)")


def optimizer_step(model, opt, loss, clip=torch.nn.utils.clip_grad_norm_) -> float:
    """backward, gradient clipping at 1.0 (`clip(params, max_norm)`: torch's for a peer, the
    trainer's for ours), the optimizer's step: what both sides do after the loss."""
    loss.backward()
    clip(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _trainer_clip(params, max_norm: float) -> float:
    from common.parallel.grads import clip_grads
    return clip_grads([p for p in params if p.requires_grad], max_norm)


class OursStep:
    """Our side: a pipeline's real training step (its components' prepare and criterion, the model,
    per-block compile where the config asks, the trainer's gradient clip, common.optim's AdamW,
    EMA). A subclass builds the config and components, then calls this __init__, and gives
    make_batch(step) -> the loader's batch dict."""

    def __init__(self, cfg, comp, make_step_fns, batch: int):
        from common.ema import EMA
        from common.optim import build_optimizer
        from common.parallel.compile import compile_blocks
        self.cfg, self.comp, self.batch, self.model = cfg, comp, batch, comp.model
        self.prepare, self.criterion = make_step_fns(comp, torch.device("cpu"))
        if cfg.parallel.compile:  # as training applies it (common/parallel): each block's forward
            compile_blocks(self.model.blocks)
        self.opt = build_optimizer(self.model, cfg.optim)
        self.ema = EMA(self.model, cfg.train.ema_decay)
        self.step_index = 0

    def make_batch(self, step: int) -> dict:
        raise NotImplementedError

    def step(self) -> float:
        i = self.step_index
        inputs, target = self.prepare(self.make_batch(i))
        loss = optimizer_step(self.model, self.opt, self.criterion(self.model(*inputs), target), _trainer_clip)
        self.ema.update(i)
        self.step_index += 1
        return loss


def timed(side, steps: int, clock=time.perf_counter) -> float:
    """Samples per second of `steps` steps of `side`, measured with `clock`."""
    t0 = clock()
    for _ in range(steps):
        side.step()
    return side.batch * steps / (clock() - t0)


def alternate(ours, peer, rounds: int, steps: int, clock: str = "wall", warmup: int = 2) -> dict:
    """Times both sides in alternating rounds after `warmup` untimed steps each (allocator,
    first-call paths, caches). Returns medians, best rounds, their ratios and every round's rate."""
    for side in (ours, peer):
        for _ in range(warmup):
            side.step()
    rates = {"ours": [], "peer": []}
    for r in range(rounds):
        order = (("ours", ours), ("peer", peer)) if r % 2 == 0 else (("peer", peer), ("ours", ours))
        for key, side in order:
            rates[key].append(timed(side, steps, CLOCKS[clock]))
    o, p = statistics.median(rates["ours"]), statistics.median(rates["peer"])
    return {"clock": clock, "ours_samples_per_s": o, "peer_samples_per_s": p, "ratio": o / p,
            "ratio_best_rounds": max(rates["ours"]) / max(rates["peer"]),
            "round_ratio_quartiles": _quartiles([a / b for a, b in zip(rates["ours"], rates["peer"])]),
            "rounds_ours": rates["ours"], "rounds_peer": rates["peer"]}


def _quartiles(values: list[float]) -> list[float]:
    # "inclusive": the quartiles stay within the values, however few rounds there are.
    return statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3


def ratio_text(row: dict) -> str:
    """The ratio as the benches print it: the median's, the best rounds', and the middle half of
    the rounds' own ratios (each of our rounds over the peer's round beside it), which shows how
    far one run's ratio can move on this machine."""
    q1, _, q3 = row["round_ratio_quartiles"]
    return (f"ratio {row['ratio']:.2f}x (best rounds {row['ratio_best_rounds']:.2f}x; "
            f"middle half of the rounds {q1:.2f}-{q3:.2f}x)")


# The kernels both sides call for the same work: GEMMs, CPU attention forward/backward, activations.
SHARED_KERNELS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "aten::gelu", "aten::gelu_backward", "aten::silu", "aten::silu_backward"})


TOP_OTHER = 6  # the largest non-shared ops listed per side: where the rest of a step goes


class _OpTimer(TorchDispatchMode):
    """Wall time per ATen op (as "aten::<name>") of everything dispatched on this thread, forward
    and backward alike (autograd runs a CPU graph's backward on the thread that calls it). Ops
    reach the mode after autograd and composite decomposition, and an op's own callees do not
    re-enter it, so each op is timed once, inclusive. Costs ~10 us per op: ~6% of a demo step,
    where torch.profiler inflated the step 1.9-2.3x on an AMD VM (and its shares with it)."""

    def __init__(self):
        super().__init__()
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        name = f"aten::{func.overloadpacket.__name__}"
        self.seconds[name] += time.perf_counter() - t0
        self.calls[name] += 1
        return out


def kernel_split(side, steps: int) -> dict:
    """One side's step time under _OpTimer and the time of SHARED_KERNELS in it, per step, both
    wall time (the CPU clock would count every thread). Eager only: dynamo cannot run compiled
    code under a Python dispatch mode."""
    timer = _OpTimer()
    with timer:
        t0 = time.perf_counter()
        for _ in range(steps):
            side.step()
        total_s = (time.perf_counter() - t0) / steps
    by_name: dict[str, float] = {}
    other: dict[str, float] = {}
    for name, seconds in timer.seconds.items():
        (by_name if name in SHARED_KERNELS else other)[name] = seconds / steps
    top_other = dict(sorted(other.items(), key=lambda kv: -kv[1])[:TOP_OTHER])
    return {"step_s": total_s, "shared_kernels_s": sum(by_name.values()), "by_kernel_s": by_name,
            "other_ops_s": sum(other.values()), "top_other_s": top_other}


def split_ceilings(ours: dict, peer: dict) -> dict:
    """The two bounds on ours/peer that removing overhead cannot pass (module docstring)."""
    return {"ceiling_no_overhead": peer["step_s"] / ours["shared_kernels_s"],
            "ceiling_peer_kernels": peer["step_s"] / peer["shared_kernels_s"]}


def check_split(ours) -> None:
    """Exits where --split cannot time our side (compiled blocks); the benches call it before the
    timed rounds."""
    if ours.cfg.parallel.compile:
        raise SystemExit("--split times eager ATen ops and cannot see inside compiled blocks: run it without "
                         "parallel.compile=true")


def split_fields(ours, peer, steps: int) -> dict:
    """--split's row fields: both sides' kernel_split and the ceilings. Run after the timed rounds
    (warm caches, and the timer's overhead cannot disturb them)."""
    o, p = kernel_split(ours, steps), kernel_split(peer, steps)
    return {"split_ours": o, "split_peer": p, **split_ceilings(o, p)}


def split_line(row: dict) -> str:
    ours, peer = row["split_ours"], row["split_peer"]
    return (f"      split (ops timed, ms/step): ours {1e3 * ours['step_s']:.1f} of which shared kernels "
            f"{1e3 * ours['shared_kernels_s']:.1f} ({ours['shared_kernels_s'] / ours['step_s']:.0%}); peer "
            f"{1e3 * peer['step_s']:.1f}, shared kernels {1e3 * peer['shared_kernels_s']:.1f} "
            f"({peer['shared_kernels_s'] / peer['step_s']:.0%}). Ceiling with no other work on our side "
            f"{row['ceiling_no_overhead']:.2f}x; with, besides, the peer's kernel times "
            f"{row['ceiling_peer_kernels']:.2f}x"
            + "".join(f"\n      {name}: other ops {1e3 * side['other_ops_s']:.1f}, outside ops (Python, autograd, "
                      f"the timer) {1e3 * (side['step_s'] - side['shared_kernels_s'] - side['other_ops_s']):.1f}; "
                      "largest other ops: " + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in side["top_other_s"].items())
                      for name, side in (("ours", ours), ("peer", peer))))


def add_arguments(p: argparse.ArgumentParser, *, configs: str, batch: int, json_name: str, root: str) -> None:
    """The options every peer bench has."""
    p.add_argument("--configs", default=configs, help="comma-separated config names")
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (median taken)")
    p.add_argument("--steps", type=int, default=0, help="steps per side per round (0: the config's default)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help=CLOCK_HELP)
    p.add_argument("--split", action="store_true",
                   help="also time each side's ATen ops (eager only) and print the time in kernels both sides "
                        "share (GEMMs, attention, activations) and the ratios that removing overhead could at most "
                        "reach")
    p.add_argument("--host-malloc", choices=("keep", "default"), default="keep",
                   help="keep (the default): glibc keeps freed memory for the whole process "
                        "(common/host_memory.py, what our trainer does on CPU), so neither side page-faults its "
                        "large buffers in again every step; default: glibc's own behaviour, under which the "
                        "page faults fall on whichever side's allocations glibc happens to serve with fresh "
                        "mappings (at DiT-S size the peer's, ~0.3 s a step, while ours took none), and the ratio "
                        "measures the allocator as much as the steps")
    p.add_argument("overrides", nargs="*", help="config overrides for our side, e.g. parallel.compile=true")
    p.add_argument("--json", default=os.path.join(root, "bench", "results", json_name))


def setup_process(args) -> None:
    """The process settings both sides share: CPU threads and glibc's malloc (--host-malloc)."""
    from common.host_memory import keep_freed_memory
    torch.set_num_threads(args.threads)
    if args.host_malloc == "keep" and not keep_freed_memory():
        print("--host-malloc keep: the C library is not glibc; its allocator is left as it is")


def write_json(path: str, args, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"threads": args.threads, "clock": args.clock, "host_malloc": args.host_malloc, "rows": rows},
                  f, indent=1)
    print(f"wrote {path}")


def measure(ours, make_peer, row: dict, args, steps: int) -> dict:
    """row + both sides' parameter counts and alternating rounds (and --split's op times). The split
    check comes before the peer is built, so a compiled run is refused before any slow setup."""
    if args.split:
        check_split(ours)
    peer = make_peer(ours)
    row = {**row, "batch": ours.batch, "params_ours": sum(q.numel() for q in ours.model.parameters()),
           "params_peer": peer.params, **alternate(ours, peer, args.rounds, steps, args.clock)}
    if args.split:
        row.update(split_fields(ours, peer, steps))
    return row


def run_configs(p: argparse.ArgumentParser, configs: dict, compare: Callable[[str, object, int], dict],
                default_steps: Callable[[str], int], describe: Callable[[dict], str]) -> list[dict]:
    """A peer bench's main: parse, set the process up, compare(name, args, steps) for each of
    --configs, print describe(row) and the ratios, write --json."""
    args = p.parse_args()
    setup_process(args)
    rows = []
    for name in args.configs.split(","):
        if name not in configs:
            p.error(f"unknown config {name!r}; choose from {sorted(configs)}")
        r = compare(name, args, args.steps or default_steps(name))
        rows.append(r)
        print(describe(r) + ratio_text(r), flush=True)
        if args.split:
            print(split_line(r), flush=True)
    write_json(args.json, args, rows)
    return rows
