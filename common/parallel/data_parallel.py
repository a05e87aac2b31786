"""Data parallelism: DDP (the baseline) and FSDP2 `fully_shard` (ZeRO-3 / ZeRO-2).

Pipelines say which submodules are the sharding units (their `parallelize.py`); this module
knows nothing about any particular model.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from common.config import ConfigError, ParallelConfig
from common.dist import DistInfo

MODES = ("none", "ddp", "fsdp")


def resolve_mode(cfg: ParallelConfig, info: DistInfo) -> str:
    mode = cfg.dp_mode
    if mode == "auto":
        return "ddp" if info.world_size > 1 else "none"
    if mode not in MODES:
        raise ConfigError(f"parallel.dp_mode={mode!r} is not one of auto, {', '.join(MODES)}")
    if mode == "none" and info.world_size > 1:
        raise ConfigError(f"parallel.dp_mode=none but world size is {info.world_size}: use ddp or fsdp")
    return mode


def apply_ddp(model: torch.nn.Module, info: DistInfo) -> torch.nn.Module:
    ids = [info.device.index] if info.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def apply_fsdp(model: torch.nn.Module, blocks: Iterable[torch.nn.Module], info: DistInfo, cfg: ParallelConfig) -> torch.nn.Module:
    """fully_shard each block, then the root (which picks up embeddings and the final layer)."""
    mesh = init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("dp_shard",))
    kwargs = {"mesh": mesh, "reshard_after_forward": cfg.reshard_after_forward}
    if info.device.type == "cuda":
        # bf16 compute with fp32 master weights and fp32 gradient reduction (DESIGN: precision policy).
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def apply_data_parallel(model: torch.nn.Module, blocks: Iterable[torch.nn.Module], info: DistInfo,
                        cfg: ParallelConfig) -> tuple[torch.nn.Module, str]:
    mode = resolve_mode(cfg, info)
    if mode == "ddp":
        return apply_ddp(model, info), mode
    if mode == "fsdp":
        return apply_fsdp(model, blocks, info, cfg), mode
    return model, mode


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model
