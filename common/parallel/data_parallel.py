"""Data parallelism: DDP (the baseline) and FSDP2 `fully_shard` (ZeRO-3 / ZeRO-2, HSDP).

A model's plan says which submodules are the sharding units (e.g. each DiT block); this module
knows nothing about any particular model.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from common.parallel.dims import ParallelDims


def apply_ddp(model: torch.nn.Module, mesh, device: torch.device) -> torch.nn.Module:
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, process_group=mesh["dp"].get_group())


def fsdp_mesh(mesh, dims: ParallelDims):
    """FSDP shards over dp_shard x cp; HSDP adds dp_replicate as the outer (replicating) dim."""
    if dims.dp_replicate > 1:
        return mesh["dp_replicate", "dp_shard_cp"]
    return mesh["dp_shard_cp"]


def apply_fsdp(model: torch.nn.Module, units: Iterable[torch.nn.Module], mesh, dims: ParallelDims,
               device: torch.device, *, reshard_after_forward: bool = True, cpu_offload: bool = False) -> torch.nn.Module:
    """fully_shard each unit (usually a block), then the root (which picks up embeddings and the final layer)."""
    kwargs = {"mesh": fsdp_mesh(mesh, dims), "reshard_after_forward": reshard_after_forward}
    if device.type == "cuda":
        # bf16 compute with fp32 master weights and fp32 gradient reduction (DESIGN: precision policy).
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def apply_data_parallel(model: torch.nn.Module, units: Iterable[torch.nn.Module], mesh, dims: ParallelDims,
                        device: torch.device, cfg) -> torch.nn.Module:
    """dims.dp_mode applied: DDP, FSDP with `units` sharded one by one (then the root), or the
    model itself. cfg: the ParallelConfig (reshard_after_forward, cpu_offload)."""
    if dims.dp_mode == "ddp":
        return apply_ddp(model, mesh, device)
    if dims.dp_mode == "fsdp":
        return apply_fsdp(model, units, mesh, dims, device, reshard_after_forward=cfg.reshard_after_forward,
                          cpu_offload=cfg.cpu_offload)
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model
