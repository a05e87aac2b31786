"""How a vision-language model (vision tower + projector + Llama, e.g. pipelines/vlm/model.py) is
parallelized: one DeviceMesh, a different plan per part.

  LM      tensor parallel (+SP) with the Llama blocks' own plans, context parallel over packed
          varlen rows (Ulysses / ring / hybrid: tokens and per-row RoPE tables sharded at the
          first block, gathered before the final norm), pipeline stages, FSDP over dp_shard x cp
  vision  FSDP only, over every rank of a pipeline stage (dp x cp x tp flattened): the tower has
          no TP/CP plan, so the ranks that hold copies of the LM's inputs (TP and CP peers) still
          split its parameters, gradients and optimizer state. Its per-rank work is balanced
          across data-parallel ranks (common/parallel/balance.py) since tiles per sample vary.

Compositions (as for the DiT, common/nn/dit_parallel.py): CP x TP (CP shards a row's tokens
before TP's sequence-parallel slice, prepended pre-hook), PP x CP / TP, and PP x FSDP, where each
stage is sharded like the whole model without pipelining (the first stage's ViT and projector over
all of that stage's ranks, LM units over dp_shard x cp) with the stage as the FSDP root that the
pipeline schedule drives: gradients reduced once per step, after the last microbatch.

Why one flattened FSDP group is exact for the vision tower: its gradient is identical on TP peers
(the blocks' TP regions all-reduce their input gradients) and, on CP peers, N x the contribution
of the rank's token shard (the gather before the head scales by N); FSDP's mean over the group
therefore gives the data-parallel mean of the true gradient, as for the LM's own reduction.

The model is duck-typed: `.visual`, `.projector`, `.lm` (common.nn.llama.Llama), `.embed(tokens,
tiles, tile_mask)`, `.vision_dispatch`, `EMBED_MODULES`; the forward inputs are (tokens, positions,
tiles, tile_mask), all batched by row.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from common.config import ConfigError
from common.data.packing import segments_from_positions
from common.dist import DistInfo
from common.nn.dit_parallel import apply_block_options
from common.parallel.dims import ParallelDims, submesh
from common.parallel.layouts import check_layout
from common.parallel.parallel_model import ParallelModel
from common.parallel.pipeline_parallel import PipelineRunner, split_layers, stage_ids


def parallelize_vlm(model, cfg, info: DistInfo, *, microbatches: int = 1, criterion=None,
                    name: str | None = None) -> ParallelModel:
    dims = ParallelDims.from_config(cfg, info.world_size)
    if dims.dp_mode == "ddp":
        if cfg.dp_mode == "ddp":
            raise ConfigError("parallel.dp_mode=ddp: the vision-language model shards its vision tower with FSDP; "
                              "use dp_mode=fsdp (or auto)")
        dims = dataclasses.replace(dims, dp_mode="fsdp")
    check_layout(dims, cfg, {}, name or type(model).__name__)
    if cfg.cpu_offload:  # _shard does not pass an offload policy: refused rather than ignored
        raise ConfigError("parallel.cpu_offload=true is not built for the vision-language model; use cpu_offload=false")
    lc = model.lm.cfg
    dims.check_model(heads=lc.n_heads, kv_heads=lc.kv_heads, layers=lc.n_layers, microbatches=microbatches)
    if info.world_size == 1:
        apply_block_options(model.lm.blocks, cfg)
        return ParallelModel(model, dims, None)
    mesh = dims.build_mesh(info.device.type)
    grad_hooks = []
    lm = model.lm
    if dims.tp > 1:
        from common.parallel.tensor_parallel import apply_tensor_parallel
        grad_hooks.append(apply_tensor_parallel(lm, mesh["tp"], sequence_parallel=cfg.sequence_parallel))
    if dims.cp > 1:
        apply_context_parallel(lm, mesh, dims)
    if dims.dp > 1:
        from common.parallel.balance import balanced_apply
        group = submesh(mesh, "dp").get_group()
        model.vision_dispatch = lambda fn, tiles: balanced_apply(fn, tiles, group)
    apply_block_options(lm.blocks, cfg)
    if dims.pp > 1:
        return _pipeline(model, dims, mesh, info, microbatches, criterion, grad_hooks, cfg)
    _shard(model, mesh, dims, info.precision, cfg)
    return ParallelModel(model, dims, mesh, grad_hooks=grad_hooks)


def _vision_mesh(mesh, dims: ParallelDims):
    names = [n for n in ("dp_replicate", "dp_shard", "cp", "tp") if getattr(dims, n) > 1]
    if not names:
        return None
    if len(names) == 1:
        return mesh[names[0]]
    sub = mesh[tuple(names)]
    return sub._flatten("vision")  # DeviceMesh._flatten: how torch builds multi-dim sub-meshes itself


def _shard(model, mesh, dims: ParallelDims, precision, cfg, *, lm_units=None, root=None) -> None:
    """fully_shard the vision tower (block by block), the projector and the LM (embedding, blocks,
    norm, head as units: the model calls them one by one, not through lm.forward), then the root.
    A pipeline stage passes its own LM units and itself as the root (model=None when the stage
    holds no vision tower)."""
    from torch.distributed.fsdp import fully_shard

    from common.parallel.data_parallel import fsdp_kwargs, fsdp_mesh
    kw = fsdp_kwargs(precision, reshard_after_forward=cfg.reshard_after_forward)
    vmesh = _vision_mesh(mesh, dims)
    if vmesh is not None and model is not None:
        for block in vision_blocks(model.visual):
            fully_shard(block, mesh=vmesh, **kw)
        fully_shard(model.visual, mesh=vmesh, **kw)
        fully_shard(model.projector, mesh=vmesh, **kw)
    if dims.dp_mode == "fsdp" and dims.dp * dims.cp > 1:
        lmesh = fsdp_mesh(mesh, dims)
        whole_model = lm_units is None
        if whole_model:
            lm, root = model.lm, model
            lm_units = [lm.tok_embeddings, *lm.blocks, lm.norm, lm.output]
        for unit in lm_units:
            fully_shard(unit, mesh=lmesh, **kw)
        if whole_model:
            fully_shard(lm, mesh=lmesh, **kw)
        # The root owns no parameter of its own (every part is a unit above); it is what makes one
        # forward/backward of the whole model (or of one pipeline stage) one FSDP step.
        fully_shard(root, mesh=lmesh if vmesh is None else vmesh, **kw)
    # Without data parallelism (tp / cp peers only) the LM keeps its plain or TP weights and the
    # vision units are roots of their own.


def vision_blocks(visual: nn.Module) -> list[nn.Module]:
    """The residual blocks of an open_clip VisionTransformer (its FSDP units)."""
    tr = getattr(visual, "transformer", None)
    blocks = getattr(tr, "resblocks", None)
    return list(blocks) if blocks is not None else []


def apply_context_parallel(lm, mesh, dims: ParallelDims) -> None:
    """Shard the packed rows' tokens over the CP ranks from the first LM block to the final norm.
    The per-row RoPE tables (R, 1, L, hd) follow their tokens; cu_seqlens stays global (the CP
    attention splits the segments itself)."""
    from common.parallel.context_parallel import ContextParallel
    cp = ContextParallel(mesh["cp"], mode=dims.cp_mode, layout="contiguous",
                         ulysses_degree=dims.cp_ulysses if dims.cp_mode == "hybrid" else None)
    first = lm.blocks[0]

    def shard_inputs(block, args):
        h, rope = args[0], args[1]
        if block is first:
            h = cp.shard(h, 1)
        return (h, tuple(cp.shard(r, 2) for r in rope), *args[2:])

    for block in lm.blocks:
        block.attention.attn_impl = cp.attention
        # prepend: the CP shard comes before the sequence-parallel TP slice of block 0's input
        block.register_forward_pre_hook(shard_inputs, prepend=True)
    lm.norm.register_forward_pre_hook(lambda _, args: (cp.gather(args[0], 1), *args[1:]))


class _LMView(nn.Module):
    """The LM parts one pipeline stage holds, under the LM's own names (lm.blocks.<i>, ...)."""

    def __init__(self, lm, block_ids, first: bool, last: bool):
        super().__init__()
        if first:
            self.tok_embeddings = lm.tok_embeddings
        self.blocks = nn.ModuleDict({str(i): lm.blocks[i] for i in block_ids})
        if last:
            self.norm, self.output = lm.norm, lm.output


class VLMStage(nn.Module):
    """One pipeline stage. First: (tokens, positions, tiles, tile_mask) -> (h, positions as float);
    middle: (h, positions) -> (h, positions); last: -> logits. Positions travel as floats (exact
    below 2^24) because stage inputs must be differentiable dtypes."""

    def __init__(self, model, block_ids, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        self._model = [model]  # not a submodule: only the parts below are this stage's
        if first:
            for name in model.EMBED_MODULES:
                setattr(self, name, getattr(model, name))
        self.lm = _LMView(model.lm, block_ids, first, last)

    def forward(self, *args):
        model = self._model[0]
        if self.first:
            tokens, positions, tiles, tile_mask = args
            h = model.embed(tokens, tiles, tile_mask)
        else:
            h, positions = args
            positions = positions.long()
        if h.is_meta or positions.numel() == 0 or bool((positions[:, 0] != 0).any()):
            # The schedule's first-step shape inference sends uninitialised tensors: real rows always
            # start at position 0 (the collate makes them), and a dense pass has the same shapes.
            cu, longest, positions = None, None, None
        else:
            cu, longest = segments_from_positions(positions)
        rope = model.lm.rope(h.shape[1], positions, h.device)
        for block in self.lm.blocks.values():
            h = block(h, rope, None, cu_seqlens=cu, max_seqlen=longest)
        if self.last:
            return self.lm.output(self.lm.norm(h))
        if positions is None:
            positions = torch.zeros(h.shape[:2], device=h.device)
        return h.contiguous(), positions.to(h.dtype).contiguous()


def _pipeline(model, dims: ParallelDims, mesh, info: DistInfo, microbatches: int, criterion,
              grad_hooks, cfg) -> ParallelModel:
    n_layers = model.lm.cfg.n_layers
    num_stages = dims.pp * dims.pp_stages_per_rank
    layers = split_layers(n_layers, num_stages)
    mine = stage_ids(mesh["pp"].get_local_rank(), dims.pp, dims.pp_stages_per_rank, dims.pp_schedule)
    stages = {s: VLMStage(model, layers[s], s == 0, s == num_stages - 1) for s in mine}
    owned = [i for s in mine for i in layers[s]]
    view = VLMStage(model, owned, 0 in mine, num_stages - 1 in mine)
    for i in range(n_layers):
        if i not in owned:
            model.lm.blocks[i] = nn.Identity()
    if dims.dp_mode == "fsdp":
        # Per stage, as without pipelining: the first stage's vision tower and projector over
        # every rank of the stage, its LM units over dp_shard x cp, the stage as the root that
        # torch.distributed.pipelining drives (gradient sync once per step, after the last
        # microbatch). The view shares these modules, hence the same sharded parameters.
        for s, stage in stages.items():
            lm_view = stage.lm
            units = [*([lm_view.tok_embeddings] if stage.first else []), *lm_view.blocks.values(),
                     *([lm_view.norm, lm_view.output] if stage.last else [])]
            _shard(model if stage.first else None, mesh, dims, info.precision, cfg, lm_units=units, root=stage)
    runner = PipelineRunner(stages, num_stages, mesh["pp"].get_group(), info.device, dims.pp_schedule,
                            microbatches, criterion)
    return ParallelModel(view, dims, mesh, pipeline=runner, grad_hooks=grad_hooks)
