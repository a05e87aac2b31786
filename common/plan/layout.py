"""One parallel layout priced on one model: bytes per rank, collectives, step time, MFU.

Mesh order is the project's (common/parallel/dims.py): pp, dp_replicate, dp_shard, cp, tp, tp
innermost. How each mechanism is modelled, and why:

Memory per rank (the worst pipeline stage: first or last)
  parameters / gradients / optimizer   fp32 master weights, fp32 gradients, AdamW's two fp32
        moments, plus the fp32 EMA copy when the run keeps one. A tensor is split by the TP plan
        (torch.chunk semantics on its `tp` dim), then FSDP2 shards dim 0 of that over dp_shard x cp
        (also chunk semantics, each rank's storage padded to ceil(rows / n) rows). DDP and
        dp_replicate hold whole (TP-local) copies.
  activations   saved tensors per block (models.block_activation_elems) x blocks of the stage x
        the microbatches in flight: 1 without PP, min(m, pp) for 1F1B on the first stage (x
        (1 + (pp-1)/(pp v)) interleaved), all m for GPipe; checkpointed blocks keep their input only,
        plus one block's activations while it is recomputed.
  buffers       FSDP2: the unsharded bf16 parameters of the unit being used and the prefetched one,
        and the fp32 reduce-scatter input of a unit; under PP x FSDP the stage stays unsharded for the
        whole step (torch.distributed.pipelining keeps reshard-after-backward and gradient sync off
        until the last microbatch), with unsharded fp32 gradients accumulated; DDP: gradient buckets
        and bf16 weight copies. Plus a fixed 2 GiB (CUDA context, cuBLAS / NCCL workspaces).
Collectives per rank and step (buffer bytes as bench/comm_volume.py counts them; wire bytes of a
ring; tests/test_plan.py checks the bytes against its CommCounter on gloo for FSDP, TP, TP+SP,
Ulysses CP, PP x FSDP and PP x TP+SP): FSDP all-gather (2 per microbatch under ZeRO-3: forward and backward; under PP once per
step plus one backward re-gather per microbatch) and reduce-scatter (per microbatch; once per step
under PP), HSDP's all-reduce over dp_replicate, DDP's all-reduce; TP's all-reduces (plain) or
all-gather / reduce-scatter pairs (SP) of every region, the DiT's context and t0 gradients, the
partial-gradient sync; CP's all-to-alls (Ulysses) or K/V ring sends, and the gather before the
final layer; PP's activation and gradient sends per microbatch.
Step time = compute + exposed communication + pipeline bubble. Compute: every linear on a roofline
(max of FLOPs at `eff` x peak and its bytes at 80% of HBM), attention at `attn_eff` x peak
(backward 2.5x forward), elementwise work as HBM traffic of the saved activations (written once
forward, read twice backward); backward is
2x forward, plus the recomputed forwards. TP, Ulysses and PP sends are on the critical path; FSDP
and DDP overlap with compute except one unit at each end; ring CP overlaps with attention. Bubble:
(pp - 1) / v stage-microbatch times (1F1B and interleaved with v stages per rank).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from common.plan.hardware import GPU, Network
from common.plan.models import (ModelDesc, ParamSpec, block_activation_elems, block_input_elems, forward_flops,
                                outside_activation_elems)

MESH = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FIXED_OVERHEAD = 2 * 2**30


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    dp_mode: str = "fsdp"          # fsdp | ddp | none
    cp_mode: str = "ulysses"       # ulysses | ring
    schedule: str = "1f1b"         # 1f1b | interleaved | gpipe
    stages_per_rank: int = 1
    microbatches: int = 1          # train.grad_accum
    micro_batch: int = 1           # samples per data-parallel rank per microbatch
    ac: str = "none"               # none | selective | full
    ac_every: int = 2
    sequence_parallel: bool = True
    reshard_after_forward: bool = True

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        return self.dp_shard * self.cp if self.dp_mode == "fsdp" else 1

    def coords(self, rank: int) -> dict[str, int]:
        out = {}
        for name in reversed(MESH):
            size = getattr(self, name)
            out[name] = rank % size
            rank //= size
        return out

    def group_ranks(self, rank: int, dims: tuple[str, ...]) -> list[int]:
        """Global ranks of `rank`'s group over the (flattened) mesh dims `dims`."""
        c = self.coords(rank)
        ranks = [0]
        for name in MESH:
            size = getattr(self, name)
            if name in dims:
                ranks = [r * size + i for r in ranks for i in range(size)]
            else:
                ranks = [r * size + c[name] for r in ranks]
        return ranks

    def stride(self, dims: tuple[str, ...]) -> int:
        inner = MESH[MESH.index(dims[-1]) + 1:]
        return math.prod(getattr(self, n) for n in inner)

    def short(self) -> str:
        return (f"pp{self.pp} dpr{self.dp_replicate} dps{self.dp_shard} cp{self.cp} tp{self.tp} "
                f"{self.dp_mode} m{self.microbatches} mb{self.micro_batch} ac={self.ac}")


def chunk(n: int, k: int, i: int) -> int:
    """Size of torch.chunk(range(n), k)[i] (0 past the last chunk): FSDP2's and DTensor's split."""
    c = -(-n // k)
    return max(0, min(c, n - i * c))


# --------------------------------------------------------------------------- parameters
def stage_of_rank(desc: ModelDesc, lay: Layout, pp_rank: int) -> tuple[list[int], bool, bool]:
    """(block indices, holds the embeddings, holds the final layer) of a pipeline rank: the
    placement of common/parallel/pipeline_parallel.py."""
    return _stage(desc.layers, lay.pp, lay.stages_per_rank if lay.pp > 1 else 1, lay.schedule, pp_rank)


@functools.lru_cache(maxsize=4096)
def _stage(layers: int, pp: int, v: int, schedule: str, pp_rank: int):
    from common.parallel.pipeline_parallel import split_layers, stage_ids
    n_stages = pp * v
    mine = stage_ids(pp_rank, pp, v, schedule) if pp > 1 else [0]
    split = split_layers(layers, n_stages)
    return [i for s in mine for i in split[s]], 0 in mine, n_stages - 1 in mine


def owned_params(desc: ModelDesc, lay: Layout, pp_rank: int) -> list[ParamSpec]:
    blocks, first, last = stage_of_rank(desc, lay, pp_rank)
    key = (id(desc), len(desc.params), tuple(blocks), first, last)
    if key not in _OWNED:
        keep = set(blocks)
        _OWNED[key] = [p for p in desc.params if (p.part == "embed" and first) or (p.part == "final" and last)
                       or (p.part == "block" and p.block in keep)]
    return _OWNED[key]


_OWNED: dict = {}


def tp_shape(p: ParamSpec, tp: int, tp_rank: int) -> tuple[int, ...]:
    if tp == 1 or p.tp is None:
        return p.shape
    s = list(p.shape)
    s[p.tp] = chunk(s[p.tp], tp, tp_rank)
    return tuple(s)


def local_numel(p: ParamSpec, lay: Layout, tp_rank: int, fsdp_rank: int, padded: bool = False) -> int:
    """Elements of this parameter on one rank: its TP shard, then FSDP's dim-0 shard of it."""
    shape = tp_shape(p, lay.tp, tp_rank)
    n = lay.fsdp_size
    if n == 1:
        return math.prod(shape)
    rows, rest = shape[0], math.prod(shape[1:])
    return (-(-rows // n) if padded else chunk(rows, n, fsdp_rank)) * rest


def rank_param_numel(desc: ModelDesc, lay: Layout, rank: int, padded: bool = False) -> int:
    """Parameter elements held by one global rank (also its gradient and each AdamW moment)."""
    c = lay.coords(rank)
    fsdp_rank = c["dp_shard"] * lay.cp + c["cp"]
    return sum(local_numel(p, lay, c["tp"], fsdp_rank, padded) for p in owned_params(desc, lay, c["pp"]))


def unsharded_numel(params: list[ParamSpec], lay: Layout, padded: bool = True) -> int:
    """A group of parameters as FSDP all-gathers them on one TP rank (rows padded to n x ceil)."""
    n = lay.fsdp_size
    total = 0
    for p in params:
        shape = tp_shape(p, lay.tp, 0)
        rows, rest = shape[0], math.prod(shape[1:])
        total += (n * -(-rows // n) if padded else rows) * rest
    return total


_SUMS: dict = {}


def stage_sums(desc: ModelDesc, lay: Layout, pp_rank: int) -> dict:
    """Element counts of a pipeline rank's parameters that memory and collectives need (cached:
    they depend on the mesh, not on the micro-batch or the checkpointing)."""
    key = (id(desc), len(desc.params), lay.pp, lay.stages_per_rank, lay.schedule, lay.tp, lay.fsdp_size, pp_rank)
    if key in _SUMS:
        return _SUMS[key]
    params = owned_params(desc, lay, pp_rank)
    blocks, _, _ = stage_of_rank(desc, lay, pp_rank)
    units = [[p for p in params if p.part == "block" and p.block == i] for i in blocks]
    root = [p for p in params if p.part != "block"]
    plain = [p for p in params if p.part == "block" and p.tp is None and not p.tp_replicated]
    qk = [p for p in plain if p.name.endswith(("q_norm.weight", "k_norm.weight"))]
    sync = (lambda ps: sum(local_numel(p, lay, 0, 0) for p in ps)) if lay.fsdp_size > 1 else \
        (lambda ps: sum(p.numel for p in ps))
    out = {"shard": sum(local_numel(p, lay, 0, 0, padded=True) for p in params),
           "unsharded": unsharded_numel(params, lay),
           "tp_local": sum(math.prod(tp_shape(p, lay.tp, 0)) for p in params),
           "biggest_unit": max([unsharded_numel(u, lay) for u in units] + [unsharded_numel(root, lay)]),
           "root_unit": unsharded_numel(root, lay),
           "sync_sp": sync(plain), "sync_plain": sync(qk)}
    _SUMS[key] = out
    return out


# --------------------------------------------------------------------------- collectives
@dataclass
class Collective:
    name: str          # what it is for, e.g. "FSDP all-gather"
    kind: str          # all_gather | reduce_scatter | all_reduce | all_to_all | send
    dims: tuple        # mesh dims of the group
    size: int          # ranks in the group
    buffer: float      # bytes per rank per step (bench/comm_volume.py's convention)
    calls: int
    overlap: str = "none"   # none | dp (with compute) | ring (with attention)
    time: float = 0.0
    exposed: float = 0.0

    @property
    def wire(self) -> float:
        n = self.size
        return {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_reduce": 2 * (n - 1) / n,
                "all_to_all": (n - 1) / n, "send": 1.0, "recv": 0.0}[self.kind] * self.buffer


def collectives(desc: ModelDesc, lay: Layout, *, pp_rank: int = 0, elem: int = 2, grad_elem: int = 4,
                step_hooks: bool = True) -> list[Collective]:
    """Every collective of one training step on a rank of pipeline rank `pp_rank`.
    elem: bytes of the compute dtype (activations, FSDP's all-gathered parameters);
    grad_elem: bytes of the gradient reduction dtype (fp32 in every layout)."""
    out: list[Collective] = []
    m, b = lay.microbatches, lay.micro_batch
    blocks, first, last = stage_of_rank(desc, lay, pp_rank)
    nb = len(blocks)
    sums = stage_sums(desc, lay, pp_rank)
    n, d, lt = desc.tokens, desc.hidden, desc.text_len
    # FSDP / HSDP / DDP
    if lay.dp_mode == "fsdp" and lay.fsdp_size > 1:
        full = sums["unsharded"]
        dims = ("dp_shard", "cp")
        if lay.pp > 1:
            gathers, reduces = m + 1, 1
        else:
            gathers, reduces = m * (2 if lay.reshard_after_forward else 1), m
        units = nb + 1
        out.append(Collective("FSDP all-gather (params)", "all_gather", dims, lay.fsdp_size,
                              gathers * full * elem, gathers * units, "dp"))
        out.append(Collective("FSDP reduce-scatter (grads)", "reduce_scatter", dims, lay.fsdp_size,
                              reduces * full * grad_elem, reduces * units, "dp"))
        if lay.dp_replicate > 1:
            shard = full // lay.fsdp_size
            out.append(Collective("HSDP all-reduce (grad shards)", "all_reduce", ("dp_replicate",),
                                  lay.dp_replicate, reduces * shard * grad_elem, reduces * units, "dp"))
    elif lay.dp_mode in ("ddp", "fsdp") and lay.dp > 1:  # ddp, or fsdp over dp_replicate only (no shard)
        full = sums["tp_local"]
        out.append(Collective("DDP all-reduce (grads)", "all_reduce", ("dp_replicate", "dp_shard"), lay.dp,
                              full * grad_elem, 1, "dp"))
    # Activations of one microbatch on this rank: tokens sharded by CP.
    ncp = n / lay.cp
    act = b * ncp * d * elem
    recomputed = {"none": 0, "full": nb, "selective": sum(1 for i in blocks if i % lay.ac_every == 0)}[lay.ac]
    fwd_blocks = nb + recomputed
    if lay.tp > 1:
        t, dims = lay.tp, ("tp",)
        regions = 3 if desc.kind == "dit" else 2
        if lay.sequence_parallel:
            boundaries = (0 in blocks) + (desc.layers - 1 in blocks)  # the stack's shard / gather hooks
            ag = (fwd_blocks + nb) * regions * act + boundaries * act
            rs = (fwd_blocks + nb) * regions * act
            out.append(Collective("TP/SP all-gather (region inputs)", "all_gather", dims, t, m * ag, 0))
            out.append(Collective("TP/SP reduce-scatter (region outputs)", "reduce_scatter", dims, t, m * rs, 0))
            ar = 0.0
        else:
            ar = (fwd_blocks + nb) * regions * act
        if desc.kind == "dit":
            ar += nb * b * lt * d * elem                       # context grad (replicated into cross k/v)
            if lay.sequence_parallel:
                ar += nb * b * 6 * d * elem                    # t0 grad (copy_to_tp_region)
        else:
            if first:
                ar += b * n * d * elem                         # vocab-split embedding output (forward)
            if last:
                ar += b * n * d * elem                         # head input grad (backward)
                out.append(Collective("TP all-gather (logits)", "all_gather", dims, t,
                                      m * b * n * desc.vocab * elem, m))
        if step_hooks:  # PartialGradSync: once per step, on the local (FSDP) shards
            ar += sums["sync_sp" if lay.sequence_parallel else "sync_plain"] * grad_elem / m
        out.append(Collective("TP all-reduce", "all_reduce", dims, t, m * ar, 0))
    if lay.cp > 1:
        c, dims = lay.cp, ("cp",)
        local = b * ncp * d / lay.tp * elem
        if lay.cp_mode == "ulysses":
            out.append(Collective("CP Ulysses all-to-all (q, k, v, out)", "all_to_all", dims, c,
                                  m * (fwd_blocks + nb) * 4 * local, m * (fwd_blocks + nb) * 4))
        else:
            sends = fwd_blocks * (c - 1) + nb * (2 * c - 1)
            out.append(Collective("CP ring send (K/V, dK/dV)", "send", dims, c, m * sends * 2 * local,
                                  m * sends, "ring"))
        if last:
            out.append(Collective("CP gather before the final layer", "all_gather", dims, c, m * b * n * d * elem, m))
    if lay.pp > 1:
        # Stage boundaries carry CP- (and, under SP, TP-) sharded tokens; the DiT passes its
        # conditioning along, the LM its positions. The mask / positions travel as floats without
        # a gradient, so the backward message lacks them. One send per tensor.
        tok = b * n / (lay.cp * (lay.tp if lay.tp > 1 and lay.sequence_parallel else 1)) * d
        if desc.kind == "dit":
            fwd, bwd, n_fwd, n_bwd = tok + b * (6 * d + d + lt * d + lt), tok + b * (6 * d + d + lt * d), 5, 4
        else:
            fwd, bwd, n_fwd, n_bwd = tok + b * n, tok, 2, 1
        v = lay.stages_per_rank
        # with v stages per rank every stage but the model's first sends gradients back and every
        # stage but the last sends activations on (the looped placement keeps both on every rank)
        sends_f = v - (1 if last else 0)
        sends_b = v - (1 if first else 0)
        out.append(Collective("PP send (activations, grads)", "send", ("pp",), lay.pp,
                              m * elem * (sends_f * fwd + sends_b * bwd), m * (sends_f * n_fwd + sends_b * n_bwd)))
        out.append(Collective("PP recv (counted at the sender)", "recv", ("pp",), lay.pp,
                              m * elem * (sends_f * bwd + sends_b * fwd), m * (sends_f * n_bwd + sends_b * n_fwd)))
    return out


# --------------------------------------------------------------------------- memory
def activation_bytes(desc: ModelDesc, lay: Layout, pp_rank: int, elem: int = 2) -> float:
    blocks, first, last = stage_of_rank(desc, lay, pp_rank)
    tp, cp, sp = lay.tp, lay.cp, lay.sequence_parallel
    full = block_activation_elems(desc, tp, cp, sp)
    inp = block_input_elems(desc, tp, cp, sp)
    ck = {"none": 0, "full": len(blocks), "selective": sum(1 for i in blocks if i % lay.ac_every == 0)}[lay.ac]
    per_mb = (len(blocks) - ck) * full + ck * inp
    if lay.pp == 1:
        inflight = 1.0
    elif lay.schedule == "gpipe":
        inflight = lay.microbatches
    else:
        inflight = min(lay.microbatches, lay.pp - pp_rank)
        if lay.stages_per_rank > 1:
            inflight = min(lay.microbatches, lay.pp) * (1 + (lay.pp - 1) / (lay.pp * lay.stages_per_rank))
    extra = full if ck else 0.0  # the block being recomputed
    outside = outside_activation_elems(desc, first, last, cp, tp)
    b = lay.micro_batch
    return b * (per_mb * inflight + extra) * elem + b * (outside["compute"] * elem + outside["fp32"] * 4)


def memory(desc: ModelDesc, lay: Layout, pp_rank: int, *, ema: bool = True, elem: int = 2) -> dict[str, float]:
    """Bytes per rank on pipeline rank `pp_rank` (its worst TP / FSDP coordinate: padded shards)."""
    sums = stage_sums(desc, lay, pp_rank)
    shard = sums["shard"]
    mem = {"params": 4 * shard, "grads": 4 * shard, "optim": (8 + (4 if ema else 0)) * shard}
    mem["activations"] = activation_bytes(desc, lay, pp_rank, elem)
    buf = FIXED_OVERHEAD
    if lay.dp_mode == "fsdp" and lay.fsdp_size > 1:
        if lay.pp > 1:
            buf += sums["unsharded"] * (elem + 4)
        else:
            biggest = sums["biggest_unit"]
            buf += (2 * biggest + sums["root_unit"]) * elem + 2 * biggest * 4
    else:  # whole (TP-local) weights: their bf16 copies, and DDP's gradient buckets
        buf += sums["tp_local"] * (elem + (4 if lay.dp > 1 else 0))
    mem["buffers"] = buf
    mem["total"] = sum(mem.values())
    return mem


# --------------------------------------------------------------------------- time
@dataclass
class Estimate:
    layout: Layout
    memory: dict
    compute: float
    comm: list = field(default_factory=list)
    exposed: float = 0.0
    bubble: float = 0.0
    step: float = 0.0
    mfu: float = 0.0
    tokens_per_s: float = 0.0
    global_batch: int = 0
    fits: bool = True


def _coll_time(c: Collective, lay: Layout, net: Network) -> float:
    if c.kind == "recv":  # the matching send carries its time
        return 0.0
    span = lay.stride(c.dims) * c.size
    intra = span <= net.gpus_per_node and net.gpus_per_node % span == 0
    bw, lat = (net.nvlink, net.nvlink_latency) if intra else (net.ib, net.ib_latency)
    steps = max(1, math.ceil(math.log2(max(c.size, 2))))
    return c.wire / bw + max(c.calls, 1) * steps * lat


def _gemm_time(rows: float, k: float, n: float, gpu: GPU, eff: float, elem: int) -> float:
    flops = 2 * rows * k * n
    traffic = elem * (rows * k + k * n + rows * n)
    return max(flops / (gpu.peak_bf16 * eff), traffic / (0.8 * gpu.hbm_bw))


def stage_forward_time(desc: ModelDesc, lay: Layout, pp_rank: int, gpu: GPU, eff: float, attn_eff: float,
                       elem: int = 2) -> tuple[float, float, float]:
    """(forward seconds of one microbatch on this stage, of which one block, of which attention)."""
    b, tp, cp = lay.micro_batch, lay.tp, lay.cp
    blocks, first, last = stage_of_rank(desc, lay, pp_rank)
    rows = {"tokens": b * desc.tokens / cp, "text": b * desc.text_len}
    t_block = 0.0
    for g in desc.gemms:
        k, n = (g.k / tp, g.n) if g.split == "k" else ((g.k, g.n / tp) if g.split == "n" else (g.k, g.n))
        t_block += _gemm_time(rows[g.rows], k, n, gpu, eff, elem)
    n_tok, d = desc.tokens, desc.hidden
    attn = 4 * b * n_tok / cp * n_tok * d / tp / (2 if desc.causal else 1)
    if desc.kind == "dit":
        attn += 4 * b * n_tok / cp * desc.text_len * d / tp
    t_attn = attn / (gpu.peak_bf16 * attn_eff)
    t_elem = b * block_activation_elems(desc, tp, cp, lay.sequence_parallel) * elem / gpu.hbm_bw
    t_block += t_attn + t_elem
    t = len(blocks) * t_block
    if desc.kind == "llama" and last:
        t += _gemm_time(b * n_tok, d, desc.vocab / tp, gpu, eff, elem)
    elif desc.kind == "dit":
        t += (first + last) * _gemm_time(b * n_tok, d, 6 * d, gpu, eff, elem) * 0.2  # embed / final: small
    return t, t_block, t_attn


def estimate(desc: ModelDesc, lay: Layout, gpu: GPU, net: Network, *, eff: float = 0.7, attn_eff: float = 0.5,
             ema: bool = True, headroom: float = 0.92) -> Estimate:
    """Memory, time and throughput of one optimizer step (the worst of the first and last stage)."""
    per_stage = []
    for pp_rank in sorted({0, lay.pp - 1}):
        mem = memory(desc, lay, pp_rank, ema=ema)
        t_fwd, t_block, t_attn = stage_forward_time(desc, lay, pp_rank, gpu, eff, attn_eff)
        blocks, _, _ = stage_of_rank(desc, lay, pp_rank)
        rec = {"none": 0, "full": len(blocks), "selective": sum(1 for i in blocks if i % lay.ac_every == 0)}[lay.ac]
        t_mb = t_fwd + 2 * t_fwd + 0.5 * len(blocks) * t_attn + rec * t_block
        compute = lay.microbatches * t_mb
        comm = collectives(desc, lay, pp_rank=pp_rank)
        dp_time = exposed = 0.0
        for c in comm:
            c.time = _coll_time(c, lay, net)
            if c.overlap == "none":
                c.exposed = c.time
            elif c.overlap == "ring":
                c.exposed = max(0.0, c.time - lay.microbatches * 3.5 * len(blocks) * t_attn)
            else:
                dp_time += c.time
            exposed += c.exposed
        # Data-parallel traffic hides behind compute, except the first gather and the last reduce.
        dp_exposed = max(0.0, dp_time - compute) + dp_time / (len(blocks) + 1)
        for c in comm:
            if c.overlap == "dp":
                c.exposed = dp_exposed * c.time / dp_time
        exposed += dp_exposed
        bubble = (lay.pp - 1) / lay.stages_per_rank * t_mb if lay.pp > 1 else 0.0
        per_stage.append(Estimate(lay, mem, compute, comm, exposed, bubble, compute + exposed + bubble))
    best = max(per_stage, key=lambda e: e.step)
    best.memory = max((e.memory for e in per_stage), key=lambda mm: mm["total"])
    g = lay.micro_batch * lay.microbatches * lay.dp
    best.global_batch = g
    best.tokens_per_s = g * desc.tokens / best.step
    best.mfu = 3 * forward_flops(desc) * g / (best.step * lay.world * gpu.peak_bf16)
    best.fits = best.memory["total"] <= headroom * gpu.memory
    return best
