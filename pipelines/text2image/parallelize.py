"""How common.parallel applies to the text2image DiT.

Order (as in torchtitan): tensor parallel -> context parallel -> activation checkpointing ->
compile -> pipeline split -> data parallel (DDP, or FSDP with each block a unit). The DiT's
conditioning (t0, timestep embedding, projected text) is computed once before the blocks and
passed between pipeline stages with the tokens, so every stage's blocks see it and its gradient
flows back to the first stage.
"""
from __future__ import annotations

import torch
from torch import nn

from common.config import ConfigError
from common.dist import DistInfo
from common.parallel.data_parallel import apply_ddp, apply_fsdp
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
        grad_hooks.append(_apply_tp(model, mesh, cfg))
    if dims.cp > 1:
        _apply_cp(model, mesh, dims)
    if cfg.activation_checkpoint != "none":
        from common.parallel.activation_checkpoint import apply_activation_checkpointing
        apply_activation_checkpointing(model.blocks, cfg.activation_checkpoint, cfg.ac_every)
    if cfg.compile:
        from common.parallel.compile import compile_blocks
        compile_blocks(model.blocks)
    if dims.pp > 1:
        return _pipeline(model, dims, mesh, info, microbatches, criterion, grad_hooks)
    if dims.dp_mode == "ddp":
        module = apply_ddp(model, mesh, info.device)
    elif dims.dp_mode == "fsdp":
        module = apply_fsdp(model, list(model.blocks), mesh, dims, info.device,
                            reshard_after_forward=cfg.reshard_after_forward, cpu_offload=cfg.cpu_offload)
    else:
        module = model
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


def _apply_tp(model: DiT, mesh, cfg):
    """DTensor plans on every block; embeddings, t_block and the final layer stay replicated.
    Returns the hook that sums the partial gradients of TP-replicated parameters each step."""
    from common.parallel.tensor_parallel import apply_tensor_parallel
    return apply_tensor_parallel(model, mesh["tp"], plan="dit", sequence_parallel=cfg.sequence_parallel)


def _apply_cp(model: DiT, mesh, dims: ParallelDims) -> None:
    """Shard the token sequence over the CP ranks from the first block to the final layer.

    Self-attention goes through ContextParallel; cross-attention needs nothing (the text is
    replicated, queries stay local) and every other layer is token-wise. The final layer runs on
    the gathered sequence, identically on every CP rank; gather's backward (local slice x cp)
    plus the gradient averaging over dp x cp make every parameter's gradient exact.
    """
    from common.parallel.context_parallel import ContextParallel
    # The DiT's attention is bidirectional, so contiguous shards already balance the work.
    cp = ContextParallel(mesh["cp"], mode=dims.cp_mode, layout="contiguous",
                         ulysses_degree=dims.cp_ulysses if dims.cp_mode == "hybrid" else None)
    cp.validate(model.cfg.heads, model.cfg.heads, model.cfg.num_tokens)
    first = model.blocks[0]

    def shard_block_inputs(block, args):
        h, t0, ctx, mask, rope = args
        if block is first:
            h = cp.shard(h, 1)
        return h, t0, ctx, mask, tuple(cp.shard(r, 0) for r in rope)  # RoPE rows follow their tokens

    for block in model.blocks:
        block.attn.attn_impl = cp.attention
        block.register_forward_pre_hook(shard_block_inputs)
    model.final.register_forward_pre_hook(lambda _, args: (cp.gather(args[0], 1), *args[1:]))
