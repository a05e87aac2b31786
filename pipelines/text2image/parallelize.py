"""How common.parallel applies to the text2image DiT (the DiT-family steps are in
common/parallel/dit.py; the pipeline split is the DiT-specific part here). The DiT's
conditioning (t0, timestep embedding, projected text) is computed once before the blocks and
passed between pipeline stages with the tokens, so every stage's blocks see it and its gradient
flows back to the first stage.
"""
from __future__ import annotations

from torch import nn

from common.config import ConfigError
from common.dist import DistInfo
from common.parallel.dit import (apply_block_options, apply_context_parallel_dit, apply_data_parallel_dit,
                                 apply_tensor_parallel_dit)
from common.parallel.dims import ParallelDims
from common.parallel.parallel_model import ParallelModel
from common.parallel.pipeline_parallel import PipelineRunner, split_layers, stage_ids
from pipelines.text2image.model import DiT


class DiTStage(nn.Module):
    """The part of a DiT that one pipeline stage runs, under the DiT's own parameter names.

    First stage: (x, t, context, mask) -> (tokens, t0, temb, text, mask); middle stages pass that
    tuple on; the last returns the prediction. The mask travels as a float (it carries no gradient).
    """

    def __init__(self, dit: DiT, block_ids, first: bool, last: bool, grid: tuple[int, int]):
        super().__init__()
        self.first, self.last, self.grid = first, last, grid
        self._dit = [dit]  # a list, so the whole DiT is not registered as a submodule
        if first:
            for name in ("patch_embed", "t_embedder", "t_block", "caption_proj", "pooled_proj"):
                setattr(self, name, getattr(dit, name))
        self.blocks = nn.ModuleDict({str(i): dit.blocks[i] for i in block_ids})
        if last:
            self.final = dit.final

    def forward(self, *args):
        dit = self._dit[0]
        if self.first:
            x, t, context, mask = args
            h, t0, temb, ctx = dit.embed(x, t, context, mask)
            mask_f = mask.float()
        else:
            h, t0, temb, ctx, mask_f = args
        rope = dit.rope(*self.grid, h.device)
        mask = mask_f > 0.5
        for block in self.blocks.values():
            h = block(h, t0, ctx, mask, rope)
        if self.last:
            return dit.head(h, temb, self.grid)
        # gloo sends only contiguous tensors
        return tuple(t.contiguous() for t in (h, t0, temb, ctx, mask_f))


def _check_supported(dims: ParallelDims, cfg) -> None:
    """Combinations not built (or not proved) yet fail here, at start, by name."""
    if dims.pp > 1 and dims.cp > 1:
        raise ConfigError(f"parallel.pp={dims.pp} with parallel.cp={dims.cp} is not supported: context parallelism "
                          "shards the token sequence across the whole block stack, which pipeline stages split")
    if dims.pp > 1 and dims.dp_mode != "none":
        raise ConfigError(f"parallel.pp={dims.pp} with data parallelism (dp={dims.dp}, dp_mode={dims.dp_mode}) is not "
                          "supported yet: run pipeline parallelism with tp only, or use fsdp without pp")
    if dims.cp > 1 and dims.tp > 1:
        raise ConfigError(f"parallel.cp={dims.cp} with parallel.tp={dims.tp} is not supported yet; use one of them "
                          "(with fsdp for the remaining ranks)")
    if dims.pp > 1 and cfg.compile:
        raise ConfigError("parallel.compile=true with parallel.pp > 1 is not supported yet")


def parallelize(model: DiT, cfg, info: DistInfo, *, microbatches: int = 1, criterion=None) -> ParallelModel:
    """cfg: the ParallelConfig; microbatches: train.grad_accum; criterion(pred, target) -> loss,
    which the last pipeline stage applies. Returns what the Trainer needs."""
    dims = ParallelDims.from_config(cfg, info.world_size)
    mc = model.cfg
    dims.check_model(heads=mc.heads, seq_len=mc.num_tokens, layers=mc.depth, microbatches=microbatches)
    _check_supported(dims, cfg)
    mesh = dims.build_mesh(info.device.type)
    grad_hooks = []
    if dims.tp > 1:
        grad_hooks.append(apply_tensor_parallel_dit(model, mesh, cfg))
    if dims.cp > 1:
        apply_context_parallel_dit(model, mesh, dims, mc.num_tokens)
    apply_block_options(model.blocks, cfg)
    if dims.pp > 1:
        return _pipeline(model, dims, mesh, info, microbatches, criterion, grad_hooks)
    module = apply_data_parallel_dit(model, dims, mesh, info.device, cfg)
    return ParallelModel(module, dims, mesh, grad_hooks=grad_hooks)


def _pipeline(model: DiT, dims: ParallelDims, mesh, info: DistInfo, microbatches: int, criterion,
              grad_hooks) -> ParallelModel:
    num_stages = dims.pp * dims.pp_stages_per_rank
    layers = split_layers(model.cfg.depth, num_stages)
    pp_rank = mesh["pp"].get_local_rank()
    mine = stage_ids(pp_rank, dims.pp, dims.pp_stages_per_rank, dims.pp_schedule)
    side = model.cfg.img_size // model.cfg.patch_size
    grid = (side, side)
    stages = {s: DiTStage(model, layers[s], s == 0, s == num_stages - 1, grid) for s in mine}
    # One view over all of this rank's stages: what the optimizer, EMA and checkpoints see.
    owned = [i for s in mine for i in layers[s]]
    view = DiTStage(model, owned, 0 in mine, num_stages - 1 in mine, grid)
    # Blocks of other ranks' stages are dropped so their memory is freed.
    for i in range(model.cfg.depth):
        if i not in owned:
            model.blocks[i] = nn.Identity()
    if 0 not in mine:
        for name in ("patch_embed", "t_embedder", "t_block", "caption_proj", "pooled_proj"):
            setattr(model, name, None)
    if num_stages - 1 not in mine:
        model.final = None

    runner = PipelineRunner(stages, num_stages, mesh["pp"].get_group(), info.device, dims.pp_schedule,
                            microbatches, criterion)
    return ParallelModel(view, dims, mesh, pipeline=runner, grad_hooks=grad_hooks)
