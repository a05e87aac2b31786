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

The plans live beside the blocks they split (this module imports no model). A block opts in by
declaring, duck-typed:
  tp_plan_name: str                          e.g. "dit", "llama" (checked against `plan=`)
  tp_regions: tuple[str, ...]                submodules whose inputs are gathered and whose heads /
                                             hidden units are split (their plain params get partial grads)
  tp_plan(sequence_parallel) -> dict         the parallelize_module plan, built from region_input,
                                             rowwise_out and torch's Colwise/RowwiseParallel
  tp_check(tp, where) -> None                ValueError naming the numbers that do not divide
  tp_sp_replicated_args: ((index, name), ...) (optional) replicated inputs consumed by token-sharded
                                             work under SP: their gradient is partial per rank, so a
                                             pre-hook wraps them in copy_to_tp_region
A model passed whole may add a model-level plan (e.g. Llama's vocab-split embedding and head):
  tp_model_plan(loss_parallel) -> dict, tp_model_check(tp) -> None.
With loss_parallel=True a model's logits stay vocab-sharded DTensors and the loss must run
inside torch.distributed.tensor.parallel.loss_parallel().
"""
from __future__ import annotations

import functools
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel, parallelize_module

SEQ_DIM = 1  # activations are (B, L, D)


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


# --------------------------------------------------------------------------- plan building blocks
# Used by the models' tp_plan methods (common.nn), which import them lazily.
def region_input(sp: bool, n_args: int = 1, replicated_extra: Sequence[int] = ()) -> PrepareModuleInput:
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


def rowwise_out(sp: bool) -> RowwiseParallel:
    """Leaving a region: reduce-scatter to sequence shards (SP) or all-reduce; plain local output
    so the residual add and the norm kernels run unchanged."""
    return RowwiseParallel(output_layouts=Shard(SEQ_DIM) if sp else Replicate())


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
def _plan_classes(name: str) -> list[str]:
    """Names of the loaded nn.Module classes declaring tp_plan_name == name: only so that a plan
    mismatch error can say which block type was expected, without importing any model."""
    found, todo = [], [nn.Module]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if vars(cls).get("tp_plan_name") == name:
            found.append(cls.__name__)
    return sorted(set(found))


def _blocks_of(module) -> tuple[list[nn.Module], str]:
    """(blocks, name prefix) from a block, a list/ModuleList of blocks or a model with .blocks."""
    if hasattr(module, "tp_plan"):
        return [module], ""
    if isinstance(module, (list, tuple, nn.ModuleList)):
        return list(module), ""
    if isinstance(getattr(module, "blocks", None), nn.ModuleList):
        return list(module.blocks), "blocks"
    raise ValueError(f"apply_tensor_parallel expects a block, a list of blocks or a model with .blocks, "
                     f"got {type(module).__name__}")


def _check_block(i: int, b, plan: str | None, tp: int) -> None:
    if not hasattr(b, "tp_plan"):
        raise ValueError(f"block {i} ({type(b).__name__}) declares no tensor-parallel plan (tp_plan)")
    if plan is not None and b.tp_plan_name != plan:
        expected = " or ".join(_plan_classes(plan)) or f"tp_plan_name={plan!r}"
        raise ValueError(f"plan {plan!r} expects {expected} blocks, block {i} is {type(b).__name__} "
                         f"(plan {b.tp_plan_name!r})")
    if any(isinstance(p, DTensor) for p in b.parameters()):
        raise ValueError(f"block {i} already holds DTensor parameters: tensor parallel applied twice?")
    b.tp_check(tp, f"block {i}")


# --------------------------------------------------------------------------- entry point
def apply_tensor_parallel(module: nn.Module | Iterable[nn.Module], tp_mesh: DeviceMesh, *, plan: str | None = None,
                          sequence_parallel: bool = False, loss_parallel: bool = False,
                          boundaries: bool = True) -> PartialGradSync:
    """Parallelize in place over the 1-D `tp_mesh` (for a 2-D mesh pass mesh["tp"]).

    module: one block, a list / ModuleList of blocks, or a model with `.blocks`; each block
    brings its own plan (tp_plan, see the module docstring). A model with `tp_model_plan`
    (Llama) also gets that applied (embedding and output head split); other models only their
    blocks. plan: optional guard, every block's tp_plan_name must equal it ("dit", "llama").
    sequence_parallel: Megatron SP between the TP regions; with boundaries=True the stack's input
    is sharded on entry to the first block and its output gathered after the last, otherwise the
    caller places shard_/gather_sequence_* hooks. loss_parallel (models with tp_model_plan only):
    keep logits vocab-sharded (DTensor) for loss_parallel().

    Apply before fully_shard (2-D FSDP x TP). Returns the PartialGradSync the trainer must call
    after backward and before clipping, every optimizer step."""
    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be 1-D (pass mesh['tp']), got a {tp_mesh.ndim}-D mesh")
    tp = tp_mesh.size()
    blocks, prefix = _blocks_of(module)
    if not blocks:
        raise ValueError("apply_tensor_parallel: no blocks to parallelize")
    for i, b in enumerate(blocks):
        _check_block(i, b, plan, tp)
    has_model_plan = hasattr(module, "tp_model_plan")
    if loss_parallel and not has_model_plan:
        raise ValueError("loss_parallel needs a model with a model-level plan (tp_model_plan, e.g. Llama: "
                         "it splits the output head)")
    if has_model_plan:
        module.tp_model_check(tp)

    entries = []
    for i, b in enumerate(blocks):
        parallelize_module(b, tp_mesh, b.tp_plan(sequence_parallel))
        name = f"{prefix}.{i}" if prefix else (str(i) if len(blocks) > 1 else "")
        entries += _partial_entries(name, b, b.tp_regions, sequence_parallel)
        if sequence_parallel:
            for index, arg in getattr(b, "tp_sp_replicated_args", ()):
                b.register_forward_pre_hook(_map_arg(lambda t: copy_to_tp_region(t, tp_mesh), index, arg),
                                            with_kwargs=True)
    if sequence_parallel and boundaries:
        shard_sequence_before(blocks[0], tp_mesh)
        gather_sequence_after(blocks[-1], tp_mesh)
    if has_model_plan:
        parallelize_module(module, tp_mesh, module.tp_model_plan(loss_parallel))
    return PartialGradSync(entries, tp_mesh)
