"""How common.parallel applies to the text2video VideoDiT.

Order (as text2image): tensor parallel -> context parallel -> activation checkpointing ->
compile -> data parallel (DDP, or FSDP with each block a unit). Pipeline parallelism is not
built for this model yet and fails at start.

Context parallelism shards the (t, h, w) token sequence of full attention: tokens and their
RoPE rows are split at the first block and gathered before the final layer, so the unpatchify
sees the whole clip. Factorized attention regroups tokens by frame / by spatial position, which
a contiguous sequence shard would cut through; that combination is refused.
"""
from __future__ import annotations

from common.config import ConfigError
from common.dist import DistInfo
from common.parallel.dit import (apply_block_options, apply_context_parallel_dit, apply_data_parallel_dit,
                                 apply_tensor_parallel_dit)
from common.parallel.dims import ParallelDims
from common.parallel.parallel_model import ParallelModel
from pipelines.text2video.model import VideoDiT


def _check_supported(dims: ParallelDims, model: VideoDiT) -> None:
    if dims.pp > 1:
        raise ConfigError(f"parallel.pp={dims.pp}: pipeline parallelism is not supported for text2video yet; "
                          "use fsdp, tp or cp")
    if dims.cp > 1 and model.cfg.attention != "full":
        raise ConfigError(f"parallel.cp={dims.cp} with model.attention={model.cfg.attention!r} is not supported: "
                          "context parallelism shards the full-attention sequence; factorized attention groups "
                          "tokens by frame and by position across frames, which the shards would cut "
                          "(use model.attention=full, or parallel.cp=1)")
    if dims.cp > 1 and dims.tp > 1:
        raise ConfigError(f"parallel.cp={dims.cp} with parallel.tp={dims.tp} is not supported yet; use one of them "
                          "(with fsdp for the remaining ranks)")


def parallelize(model: VideoDiT, cfg, info: DistInfo, *, microbatches: int = 1, criterion=None) -> ParallelModel:
    """cfg: the ParallelConfig. Returns what the Trainer needs."""
    dims = ParallelDims.from_config(cfg, info.world_size)
    mc = model.cfg
    _check_supported(dims, model)
    dims.check_model(heads=mc.heads, seq_len=mc.num_tokens, layers=mc.depth, microbatches=microbatches)
    mesh = dims.build_mesh(info.device.type)
    grad_hooks = []
    if dims.tp > 1:
        grad_hooks.append(apply_tensor_parallel_dit(model, mesh, cfg))
    if dims.cp > 1:
        apply_context_parallel_dit(model, mesh, dims, mc.num_tokens)
    apply_block_options(model.blocks, cfg)
    module = apply_data_parallel_dit(model, dims, mesh, info.device, cfg)
    return ParallelModel(module, dims, mesh, grad_hooks=grad_hooks)
