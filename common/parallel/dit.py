"""How common.parallel applies to DiT-family models (the image and the video DiT).

Both hold a stack `model.blocks` of common.nn.DiTBlock, called as block(h, t0, ctx, mask, rope),
followed by `model.final`. Pipelines call these in torchtitan's order: tensor parallel ->
context parallel -> activation checkpointing -> compile -> (pipeline split) -> data parallel.
"""
from __future__ import annotations

from torch import nn

from common.parallel.data_parallel import apply_ddp, apply_fsdp
from common.parallel.dims import ParallelDims


def apply_tensor_parallel_dit(model: nn.Module, mesh, cfg):
    """DTensor plans on every block; embeddings, t_block and the final layer stay replicated.
    Returns the hook that sums the partial gradients of TP-replicated parameters each step."""
    from common.parallel.tensor_parallel import apply_tensor_parallel
    return apply_tensor_parallel(model, mesh["tp"], plan="dit", sequence_parallel=cfg.sequence_parallel)


def apply_context_parallel_dit(model: nn.Module, mesh, dims: ParallelDims, num_tokens: int) -> None:
    """Shard the token sequence over the CP ranks from the first block to the final layer.

    Self-attention goes through ContextParallel; cross-attention needs nothing (the text is
    replicated, queries stay local) and every other layer is token-wise. The final layer runs on
    the gathered sequence, identically on every CP rank; gather's backward (local slice x cp)
    plus the gradient averaging over dp x cp make every parameter's gradient exact.
    """
    from common.parallel.context_parallel import ContextParallel
    # DiT attention is bidirectional, so contiguous shards already balance the work.
    cp = ContextParallel(mesh["cp"], mode=dims.cp_mode, layout="contiguous",
                         ulysses_degree=dims.cp_ulysses if dims.cp_mode == "hybrid" else None)
    heads = model.blocks[0].attn.heads
    cp.validate(heads, heads, num_tokens)
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


def apply_block_options(blocks: nn.ModuleList, cfg) -> None:
    """Activation checkpointing, then per-block compile (both keep parameter names)."""
    if cfg.activation_checkpoint != "none":
        from common.parallel.activation_checkpoint import apply_activation_checkpointing
        apply_activation_checkpointing(blocks, cfg.activation_checkpoint, cfg.ac_every)
    if cfg.compile:
        from common.parallel.compile import compile_blocks
        compile_blocks(blocks)


def apply_data_parallel_dit(model: nn.Module, dims: ParallelDims, mesh, device, cfg) -> nn.Module:
    """DDP, or FSDP with each block a unit (then the root), or the model itself."""
    if dims.dp_mode == "ddp":
        return apply_ddp(model, mesh, device)
    if dims.dp_mode == "fsdp":
        return apply_fsdp(model, list(model.blocks), mesh, dims, device,
                          reshard_after_forward=cfg.reshard_after_forward, cpu_offload=cfg.cpu_offload)
    return model
