"""Tensor and sequence parallelism (Megatron-style) through DTensor `parallelize_module` plans.

Inside a block, attention and the MLP are TP regions: q/k/v (and MLP up-projections) are split
column-wise, so each rank holds whole heads / a slice of the hidden units, and the output
projections row-wise, so one collective per region restores the full width. Everything else in
a block (residual stream, norms, adaLN modulation) runs on plain local tensors:

* plain TP: replicated (B, L, D) activations; entering a region is free forward and all-reduces
  the input gradient backward; leaving it all-reduces the output.
* sequence parallel (SP): between regions the residual stream is sharded along the sequence
  (dim 1, (B, L/tp, D) per rank). Entering a region all-gathers (backward: reduce-scatter),
  leaving it reduce-scatters (backward: all-gather): same traffic as plain TP, but norms,
  modulation and residual adds touch 1/tp of the tokens and store 1/tp of the activations.
  The block stack stays self-contained: a pre-hook on the first block slices its (replicated)
  input and a hook on the last block all-gathers its output (helpers below), so the model code
  around the blocks (embeddings, final layer, loss) never sees a shard.

Parameters that stay plain tensors on every TP rank but whose gradient on one rank is only a
partial sum (per-head QK-norm weights: each rank holds a subset of heads; under SP every plain
parameter outside the regions: norm weights, adaLN tables, since each rank sees a subset of the
tokens) are collected in a `PartialGradSync`, which the trainer calls once per optimizer step
after backward and before clipping: it all-reduces (SUM) their gradients over the TP group in
one flat buffer. We chose this over Replicate DTensors because those would force the
norm/modulation kernels to run on DTensors (dispatch overhead, op coverage) instead of plain
local shards, and because it composes with FSDP: fully_shard swaps these parameters for
dp-sharded DTensors, so the sync looks them up by (module, name) at call time and reduces the
local shard of the gradient (every TP rank holds the same dp shard of the same parameter).
Parameters split or replicated *as DTensors* by the plan (linear weights, row-wise biases,
the Llama embedding and head) need nothing: DTensor's autograd reduces their gradients.

adaLN-single (DiT): t0 (B, 6D) is computed once per model from replicated inputs and passed to
every block; each block's scale_shift_table (6, D) stays a plain replicated parameter, so the
modulation is bitwise the same on every rank. Under SP the modulation is applied to a token
shard, so each block's dL/dt0 is partial: a pre-hook wraps t0 in a "copy to TP region" op
(identity forward, all-reduce backward; one B x 6D all-reduce per block), keeping the gradient
of the timestep MLP upstream exact; the tables themselves are in the partial-grad sync.

Llama model plan: the embedding is split row-wise (by vocabulary, output all-reduced to a
replicated (B, L, D)), the output head column-wise. Logits are all-gathered to a replicated
(B, L, V) plain tensor by default, so any loss works unchanged; with loss_parallel=True they stay
vocab-sharded DTensors and the loss must run inside torch.distributed.tensor.parallel.loss_parallel().
"""
from __future__ import annotations

import functools
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module

from common.nn.dit_block import DiTBlock
from common.nn.llama import Llama, LlamaBlock

PLANS = ("dit", "llama")
SEQ_DIM = 1  # activations are (B, L, D)

# Submodules of each block type whose inputs are gathered/replicated and whose heads or hidden
# units are split: plain parameters inside them get partial gradients even without SP.
_REGIONS = {"dit": ("attn", "cross_attn", "mlp"), "llama": ("attention", "mlp")}


# --------------------------------------------------------------------------- activation layouts
def _check_seq(x: torch.Tensor, tp: int) -> None:
    if x.shape[SEQ_DIM] % tp:
        raise ValueError(f"sequence parallel: sequence length {x.shape[SEQ_DIM]} (dim {SEQ_DIM} of the block-stack "
                         f"input {tuple(x.shape)}) is not divisible by the tensor-parallel degree {tp}")


def shard_sequence(x: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """Replicated (B, L, D) -> this rank's (B, L/tp, D). Forward slices; backward all-gathers,
    since everything upstream runs replicated and needs the gradient of every token."""
    _check_seq(x, tp_mesh.size())
    dt = DTensor.from_local(x, tp_mesh, (Replicate(),), run_check=False)
    return dt.redistribute(tp_mesh, (Shard(SEQ_DIM),)).to_local()


def gather_sequence(x: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """(B, L/tp, D) shard -> replicated (B, L, D). Backward slices this rank's tokens out of the
    gradient, which is right because downstream of here runs replicated: every rank holds the
    same full gradient. (Were downstream TP-split, the gradient would be partial and this would
    have to be a reduce-scatter instead: that is what the Shard(1) input layouts of the TP
    regions do.)"""
    dt = DTensor.from_local(x, tp_mesh, (Shard(SEQ_DIM),), run_check=False)
    return dt.redistribute(tp_mesh, (Replicate(),)).to_local()


def copy_to_tp_region(x: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward, all-reduce (SUM) of the gradient backward (Megatron's `f`): for a
    replicated tensor consumed by work that each TP rank does only a part of."""
    dt = DTensor.from_local(x, tp_mesh, (Replicate(),), run_check=False)
    return dt.to_local(grad_placements=(Partial(),))


def _map_arg(fn, index: int, name: str):
    """Forward pre-hook (with_kwargs) applying fn to the argument at `index` / keyword `name`."""
    def hook(_module, args, kwargs):
        if name in kwargs:
            kwargs = {**kwargs, name: fn(kwargs[name])}
        elif len(args) > index:
            args = (*args[:index], fn(args[index]), *args[index + 1:])
        return args, kwargs
    return hook


def shard_sequence_before(module: nn.Module, tp_mesh: DeviceMesh, index: int = 0, name: str = "x"):
    """Register a pre-hook that sequence-shards `module`'s input (the first block of a stack).
    Returns the hook handle."""
    return module.register_forward_pre_hook(_map_arg(lambda x: shard_sequence(x, tp_mesh), index, name),
                                            with_kwargs=True)


def gather_sequence_before(module: nn.Module, tp_mesh: DeviceMesh, index: int = 0, name: str = "x"):
    """Register a pre-hook that all-gathers `module`'s sequence-sharded input (e.g. a final
    layer when the stack was applied with boundaries=False). Returns the hook handle."""
    return module.register_forward_pre_hook(_map_arg(lambda x: gather_sequence(x, tp_mesh), index, name),
                                            with_kwargs=True)


def gather_sequence_after(module: nn.Module, tp_mesh: DeviceMesh):
    """Register a hook that all-gathers `module`'s sequence-sharded output (the last block)."""
    return module.register_forward_hook(lambda _m, _args, out: gather_sequence(out, tp_mesh))


# --------------------------------------------------------------------------- plans
def _region_input(sp: bool, n_args: int = 1, replicated_extra: Sequence[int] = ()) -> PrepareModuleInput:
    """Layouts for a TP region's positional inputs: arg 0 is the residual-stream activation
    (Shard(1) under SP, else Replicate), `replicated_extra` are replicated tensors (cross-attn
    context), the rest pass through. Outputs stay DTensors (use_local_output=False) so the
    q/k/v (or w1/w3) linears share one input: their Partial input gradients are summed as
    DTensors and reduced by a single collective (reduce-scatter under SP, all-reduce otherwise)
    instead of one per linear."""
    src = [None] * n_args
    dst = [None] * n_args
    src[0], dst[0] = (Shard(SEQ_DIM) if sp else Replicate()), Replicate()
    for i in replicated_extra:
        src[i] = dst[i] = Replicate()
    return PrepareModuleInput(input_layouts=tuple(src), desired_input_layouts=tuple(dst))


def _row(sp: bool) -> RowwiseParallel:
    # Leaving a region: reduce-scatter to sequence shards (SP) or all-reduce; plain local output
    # so the residual add and the norm kernels run unchanged.
    return RowwiseParallel(output_layouts=Shard(SEQ_DIM) if sp else Replicate())


def dit_block_plan(sequence_parallel: bool) -> dict:
    sp = sequence_parallel
    plan = {"attn": _region_input(sp),
            # DiTBlock calls cross_attn(x, context, context_mask): context is replicated.
            "cross_attn": _region_input(sp, 3, replicated_extra=(1,)),
            "mlp": _region_input(sp),
            "mlp.fc1": ColwiseParallel(), "mlp.fc2": _row(sp)}
    for attn in ("attn", "cross_attn"):
        plan.update({f"{attn}.to_q": ColwiseParallel(), f"{attn}.to_k": ColwiseParallel(),
                     f"{attn}.to_v": ColwiseParallel(), f"{attn}.proj": _row(sp)})
    return plan


def llama_block_plan(sequence_parallel: bool) -> dict:
    sp = sequence_parallel
    # LlamaBlock calls attention(x, rope, attn_mask) and mlp(x).
    return {"attention": _region_input(sp, 3),
            "attention.to_q": ColwiseParallel(), "attention.to_k": ColwiseParallel(),
            "attention.to_v": ColwiseParallel(), "attention.proj": _row(sp),
            "mlp": _region_input(sp),
            "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(), "mlp.w2": _row(sp)}


def llama_model_plan(loss_parallel: bool = False) -> dict:
    """Embedding split by vocabulary rows (output all-reduced, replicated so that callers may
    splice other embeddings in before the blocks); head split by vocabulary columns."""
    head = (ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) if loss_parallel
            else ColwiseParallel(output_layouts=Replicate()))
    return {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "output": head}


# --------------------------------------------------------------------------- partial gradients
class PartialGradSync:
    """All-reduces (SUM over the TP group) the gradients of replicated parameters that each TP
    rank computes only part of. Call once per optimizer step, after the last backward (after
    FSDP's reduce-scatter, i.e. after backward returns) and before gradient clipping; with
    gradient accumulation, once after the last micro-batch (the sum is linear).

    Entries are (owner module, parameter name), resolved at call time so that parameters
    replaced by fully_shard (dp-sharded DTensors) are found; a DTensor gradient is reduced
    through its local shard."""

    def __init__(self, entries: list[tuple[str, nn.Module, str]], tp_mesh: DeviceMesh | None):
        self.entries = entries
        self.tp_mesh = tp_mesh

    @property
    def names(self) -> list[str]:
        return [qualname for qualname, _, _ in self.entries]

    def parameters(self) -> list[nn.Parameter]:
        return [getattr(owner, attr) for _, owner, attr in self.entries]

    def __len__(self) -> int:
        return len(self.entries)

    @torch.no_grad()
    def __call__(self) -> None:
        if self.tp_mesh is None or self.tp_mesh.size() == 1:
            return
        grads = []
        for p in self.parameters():
            if p.grad is not None:
                g = p.grad
                grads.append(g._local_tensor if isinstance(g, DTensor) else g)
        # One flat all-reduce per (device, dtype) instead of one per tiny norm weight.
        buckets: dict[tuple, list[torch.Tensor]] = {}
        for g in grads:
            buckets.setdefault((g.device, g.dtype), []).append(g)
        group = self.tp_mesh.get_group()
        for _, gs in sorted(buckets.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
            flat = torch.cat([g.reshape(-1) for g in gs])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            offset = 0
            for g in gs:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


def _partial_entries(prefix: str, block: nn.Module, regions: Sequence[str], sp: bool) -> list:
    out = []
    for mod_name, mod in block.named_modules():
        for attr, p in mod.named_parameters(recurse=False):
            if isinstance(p, DTensor):
                continue  # DTensor autograd already gives the full gradient
            in_region = any(mod_name == r or mod_name.startswith(r + ".") for r in regions)
            if in_region or sp:
                qual = ".".join(s for s in (prefix, mod_name, attr) if s)
                out.append((qual, mod, attr))
    return out


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for models whose gradients mix plain tensors and DTensors
    on different meshes/layouts (TP-only leaves QK-norm and norm weights plain; FSDP x TP puts
    TP weights on the 2-D mesh and the rest on the dp mesh): torch's version runs one foreach
    norm over all of them and fails. Norms are taken per (mesh, placements) group, each group's
    norm made global with full_tensor(), and combined. Call after the partial-grad sync.
    Returns the total norm as a plain tensor."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            g = p.grad
            key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
            groups.setdefault(key, []).append(p)
    if not groups:
        return torch.tensor(0.0)
    norms = []
    for ps in groups.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in ps], norm_type)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    dtype = functools.reduce(torch.promote_types, [n.dtype for n in norms], torch.float32)
    total = torch.linalg.vector_norm(torch.stack([n.to(dtype) for n in norms]), norm_type)
    for ps in groups.values():
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total.to(ps[0].grad.device))
    return total


# --------------------------------------------------------------------------- validation
def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _validate_dit(i: int, b: DiTBlock, tp: int) -> None:
    where = f"DiT block {i}"
    _need(b.hidden % tp == 0, f"{where}: hidden size {b.hidden} is not divisible by tensor-parallel degree {tp}")
    for name, attn in (("self-attention", b.attn), ("cross-attention", b.cross_attn)):
        _need(attn.heads % tp == 0, f"{where}: {name} heads {attn.heads} are not divisible by "
                                    f"tensor-parallel degree {tp}")
    h = b.mlp.fc1.out_features
    _need(h % tp == 0, f"{where}: MLP hidden size {h} is not divisible by tensor-parallel degree {tp}")


def _validate_llama(i: int, b: LlamaBlock, tp: int) -> None:
    where, a = f"Llama block {i}", b.attention
    dim = a.to_q.in_features
    _need(dim % tp == 0, f"{where}: dim {dim} is not divisible by tensor-parallel degree {tp}")
    _need(a.n_heads % tp == 0, f"{where}: attention heads {a.n_heads} are not divisible by tensor-parallel degree {tp}")
    _need(a.n_kv_heads % tp == 0, f"{where}: kv heads {a.n_kv_heads} are not divisible by tensor-parallel "
                                  f"degree {tp} (each rank must hold whole kv heads of its query groups)")
    h = b.mlp.w1.out_features
    _need(h % tp == 0, f"{where}: SwiGLU hidden size {h} is not divisible by tensor-parallel degree {tp}")


def _blocks_of(module) -> tuple[list[nn.Module], str]:
    """(blocks, name prefix) from a block, a list/ModuleList of blocks or a model with .blocks."""
    if isinstance(module, (DiTBlock, LlamaBlock)):
        return [module], ""
    if isinstance(module, (list, tuple, nn.ModuleList)):
        return list(module), ""
    if isinstance(getattr(module, "blocks", None), nn.ModuleList):
        return list(module.blocks), "blocks"
    raise ValueError(f"apply_tensor_parallel expects a block, a list of blocks or a model with .blocks, "
                     f"got {type(module).__name__}")


# --------------------------------------------------------------------------- entry point
def apply_tensor_parallel(module: nn.Module | Iterable[nn.Module], tp_mesh: DeviceMesh, *, plan: str,
                          sequence_parallel: bool = False, loss_parallel: bool = False,
                          boundaries: bool = True) -> PartialGradSync:
    """Parallelize in place over the 1-D `tp_mesh` (for a 2-D mesh pass mesh["tp"]).

    module: one block, a list / ModuleList of blocks, or a model with `.blocks` (a `Llama` also
    gets its embedding and output head split; other models only their blocks). plan: "dit"
    (DiTBlock) or "llama" (LlamaBlock). sequence_parallel: Megatron SP between the TP regions;
    with boundaries=True the stack's input is sharded on entry to the first block and its output
    gathered after the last, otherwise the caller places shard_/gather_sequence_* hooks.
    loss_parallel (Llama model only): keep logits vocab-sharded (DTensor) for loss_parallel().

    Apply before fully_shard (2-D FSDP x TP). Returns the PartialGradSync the trainer must call
    after backward and before clipping, every optimizer step."""
    if plan not in PLANS:
        raise ValueError(f"unknown tensor-parallel plan {plan!r}; expected one of {PLANS}")
    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be 1-D (pass mesh['tp']), got a {tp_mesh.ndim}-D mesh")
    tp = tp_mesh.size()
    blocks, prefix = _blocks_of(module)
    if not blocks:
        raise ValueError("apply_tensor_parallel: no blocks to parallelize")
    block_type, validate = (DiTBlock, _validate_dit) if plan == "dit" else (LlamaBlock, _validate_llama)
    for i, b in enumerate(blocks):
        if not isinstance(b, block_type):
            raise ValueError(f"plan {plan!r} expects {block_type.__name__} blocks, block {i} is {type(b).__name__}")
        if any(isinstance(p, DTensor) for p in b.parameters()):
            raise ValueError(f"block {i} already holds DTensor parameters: tensor parallel applied twice?")
        validate(i, b, tp)
    is_llama_model = isinstance(module, Llama)
    if loss_parallel and not is_llama_model:
        raise ValueError("loss_parallel needs a Llama model (it splits the output head)")
    if is_llama_model:
        v = module.cfg.vocab_size
        _need(v % tp == 0, f"Llama: vocab size {v} is not divisible by tensor-parallel degree {tp} "
                           "(embedding and output head are split by vocabulary)")

    block_plan = dit_block_plan(sequence_parallel) if plan == "dit" else llama_block_plan(sequence_parallel)
    entries = []
    for i, b in enumerate(blocks):
        parallelize_module(b, tp_mesh, block_plan)
        name = f"{prefix}.{i}" if prefix else (str(i) if len(blocks) > 1 else "")
        entries += _partial_entries(name, b, _REGIONS[plan], sequence_parallel)
        if sequence_parallel and plan == "dit":
            b.register_forward_pre_hook(_map_arg(lambda t: copy_to_tp_region(t, tp_mesh), 1, "t0"),
                                        with_kwargs=True)
    if sequence_parallel and boundaries:
        shard_sequence_before(blocks[0], tp_mesh)
        gather_sequence_after(blocks[-1], tp_mesh)
    if is_llama_model:
        parallelize_module(module, tp_mesh, llama_model_plan(loss_parallel))
    return PartialGradSync(entries, tp_mesh)
