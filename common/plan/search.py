"""Enumerate the layouts that divide a model and fit a GPU, price each, rank by step time.

A layout is (pp, schedule, dp_replicate, dp_shard, cp, cp_mode, tp, microbatches, micro-batch, AC).
What divides is decided with the project's own rule, ParallelDims.check_model (heads, kv heads,
tokens per CP / SP shard, blocks per pipeline stage, microbatches per pipeline degree), plus the
global batch splitting evenly over the data-parallel ranks. Per (mesh, AC mode) the planner keeps
the micro-batch size with the fastest step that fits.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.config import ConfigError
from common.plan.hardware import GPU, Network
from common.plan.layout import Estimate, Layout, estimate
from common.plan.models import ModelDesc


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class SearchResult:
    ranked: list[Estimate]       # fitting layouts, fastest first
    too_big: int                 # (mesh, AC) pairs with no micro-batch that fits
    not_dividing: int            # meshes the model or the batch does not divide
    best_unfit: Estimate | None  # the smallest-memory layout when nothing fits


def check(desc: ModelDesc, lay: Layout) -> str | None:
    """Why this layout cannot run the model (None: it can), as ParallelDims.check_model says."""
    from common.parallel.dims import ParallelDims
    dims = ParallelDims(dp_replicate=lay.dp_replicate, dp_shard=lay.dp_shard, cp=lay.cp, tp=lay.tp, pp=lay.pp,
                        world_size=lay.world, dp_mode=lay.dp_mode, cp_mode=lay.cp_mode,
                        cp_ulysses=lay.cp if lay.cp_mode == "ulysses" and lay.cp > 1 else 1,
                        pp_schedule=lay.schedule, pp_stages_per_rank=lay.stages_per_rank)
    try:
        dims.check_model(heads=desc.heads, kv_heads=desc.kv_heads, seq_len=desc.tokens, layers=desc.layers,
                         microbatches=lay.microbatches if lay.pp > 1 else None)
    except ConfigError as e:
        return str(e)
    for name, size in (("hidden", desc.hidden), ("MLP hidden", desc.ffn)):
        if size % lay.tp:
            return f"parallel.tp={lay.tp}: {name} size {size} is not divisible by {lay.tp}"
    if desc.vocab and desc.vocab % lay.tp:
        return f"parallel.tp={lay.tp}: vocabulary {desc.vocab} is not divisible by {lay.tp}"
    return None


def meshes(desc: ModelDesc, world: int, gpus_per_node: int, max_tp: int = 16, max_cp: int = 32):
    """Candidate (pp, schedule, v, dp_replicate, dp_shard, cp, cp_mode, tp, dp_mode) tuples."""
    for pp in divisors(desc.layers):
        if world % pp:
            continue
        scheds = [("1f1b", 1)]
        if pp > 1 and desc.layers % (2 * pp) == 0:
            scheds.append(("interleaved", 2))
        for tp in divisors(max_tp):
            if world % (pp * tp):
                continue
            for cp in divisors(max_cp):
                if world % (pp * tp * cp):
                    continue
                dp = world // (pp * tp * cp)
                cp_mode = "ulysses" if cp == 1 or (desc.heads // tp) % cp == 0 else "ring"
                dp_opts = []
                if dp * cp > 1:
                    dp_opts.append((1, dp, "fsdp"))
                    for s in divisors(dp):  # HSDP: shard within a node or a few, replicate across
                        if 1 < s < dp and s * cp * tp in {gpus_per_node * k for k in (1, 2, 4, 8)}:
                            dp_opts.append((dp // s, s, "fsdp"))
                    if tp == 1 and cp == 1 and dp > 1:
                        dp_opts.append((dp, 1, "ddp"))
                else:
                    dp_opts.append((1, 1, "none"))
                for sched, v in scheds:
                    for r, s, mode in dp_opts:
                        yield Layout(pp=pp, dp_replicate=r, dp_shard=s, cp=cp, tp=tp, dp_mode=mode, cp_mode=cp_mode,
                                     schedule=sched, stages_per_rank=v)


def search(desc: ModelDesc, world: int, global_batch: int, gpu: GPU, net: Network, *, eff: float = 0.7,
           attn_eff: float = 0.5, ema: bool = True, ac_modes=("none", "selective", "full"),
           max_micro_batch: int = 256) -> SearchResult:
    from dataclasses import replace
    ranked, too_big, not_dividing, best_unfit = [], 0, 0, None
    for base in meshes(desc, world, net.gpus_per_node):
        if global_batch % base.dp:
            not_dividing += 1
            continue
        per_rank = global_batch // base.dp
        options = [b for b in divisors(per_rank) if b <= max_micro_batch]
        if base.pp > 1:
            options = [b for b in options if (per_rank // b) % base.pp == 0]
        probe = replace(base, micro_batch=options[0] if options else 1,
                        microbatches=per_rank // options[0] if options else 1)
        if not options or check(desc, probe):
            not_dividing += 1
            continue
        for ac in ac_modes:
            best = None
            for b in options:
                lay = replace(base, micro_batch=b, microbatches=per_rank // b, ac=ac)
                est = estimate(desc, lay, gpu, net, eff=eff, attn_eff=attn_eff, ema=ema)
                if not est.fits:
                    if best_unfit is None or est.memory["total"] < best_unfit.memory["total"]:
                        best_unfit = est
                    continue
                if best is None or est.step < best.step:
                    best = est
            if best is None:
                too_big += 1
            else:
                ranked.append(best)
    ranked.sort(key=lambda e: e.step)
    return SearchResult(ranked, too_big, not_dividing, best_unfit)
