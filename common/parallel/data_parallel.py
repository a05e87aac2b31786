"""Data parallelism: DDP (the baseline) and FSDP2 `fully_shard` (ZeRO-3 / ZeRO-2, HSDP).

A model's plan says which submodules are the sharding units (e.g. each DiT block); this module
knows nothing about any particular model.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from common.parallel.dims import ParallelDims, submesh
from common.precision.policy import PrecisionPolicy


def apply_ddp(model: torch.nn.Module, mesh, device: torch.device) -> torch.nn.Module:
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, process_group=submesh(mesh, "dp").get_group())


def fsdp_mesh(mesh, dims: ParallelDims):
    """FSDP shards over dp_shard x cp; HSDP adds dp_replicate as the outer (replicating) dim."""
    if dims.dp_replicate == 1:
        return submesh(mesh, "dp_shard_cp")
    if dims.cp == 1:
        return mesh["dp_replicate", "dp_shard"]
    # HSDP x CP: mesh["dp_replicate", "dp_shard_cp"] would slice a flattened dim from the root,
    # which torch deprecates (see dims.submesh). dp_cp spans (dp_replicate, dp_shard, cp),
    # outermost first, so unflattened into (dp_replicate, dp_shard x cp) it is the same 2-D mesh.
    # Unflattening creates process groups (a collective over all ranks): once per world mesh.
    sizes = (dims.dp_replicate, dims.dp_shard * dims.cp)
    made = mesh.__dict__.setdefault("_hsdp_cp_meshes", {})
    if sizes not in made:
        made[sizes] = submesh(mesh, "dp_cp")._unflatten(0, sizes, ("dp_replicate", "dp_shard_cp"))
    return made[sizes]


def fsdp_kwargs(precision: PrecisionPolicy | None, *, reshard_after_forward: bool = True,
                cpu_offload: bool = False) -> dict:
    """fully_shard options every sharded unit shares: the precision policy's MixedPrecisionPolicy
    (compute-dtype parameters in forward/backward, reduce-dtype gradients, fp32 shards)."""
    kwargs = {"reshard_after_forward": reshard_after_forward}
    mp = precision.fsdp_mp_policy() if precision is not None else None
    if mp is not None:
        kwargs["mp_policy"] = mp
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    return kwargs


def apply_fsdp(model: torch.nn.Module, units: Iterable[torch.nn.Module], mesh, dims: ParallelDims, *,
               precision: PrecisionPolicy | None = None, reshard_after_forward: bool = True,
               cpu_offload: bool = False, shard_mesh=None) -> torch.nn.Module:
    """fully_shard each unit (usually a block), then the root (which picks up embeddings and the final layer).
    shard_mesh: the mesh to shard over (default: the FSDP mesh of `dims`)."""
    kwargs = {"mesh": fsdp_mesh(mesh, dims) if shard_mesh is None else shard_mesh,
              **fsdp_kwargs(precision, reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload)}
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def apply_data_parallel(model: torch.nn.Module, units: Iterable[torch.nn.Module], mesh, dims: ParallelDims,
                        info, cfg) -> torch.nn.Module:
    """dims.dp_mode applied: DDP, FSDP with `units` sharded one by one (then the root), or the
    model itself. info: the DistInfo (device, precision policy); cfg: the ParallelConfig
    (reshard_after_forward, cpu_offload)."""
    if dims.dp_mode == "ddp":
        return apply_ddp(model, mesh, info.device)
    if dims.dp_mode == "fsdp":
        return apply_fsdp(model, units, mesh, dims, precision=info.precision,
                          reshard_after_forward=cfg.reshard_after_forward, cpu_offload=cfg.cpu_offload)
    return model


def replicate_mesh(mesh, dims: ParallelDims):
    """(dp, 1) 2-D mesh: fully_shard on it is HSDP with a shard group of one, i.e. DDP's semantics
    (whole parameters on every rank, gradients all-reduced/averaged over dp) on FSDP2's hooks."""
    if dims.dp_replicate > 1:
        return mesh["dp_replicate", "dp_shard"]  # dp_shard == 1 under ddp
    return mesh["dp_shard", "cp"]  # cp == 1 under ddp


def shard_pipeline_stages(stages: Iterable[torch.nn.Module], units_of, mesh, dims: ParallelDims, info, cfg) -> None:
    """Data parallelism inside each pipeline stage: fully_shard every unit of a stage
    (units_of(stage), e.g. its blocks), then the stage module itself, which becomes the root
    owning the stage's remaining parameters (embeddings on the first stage, the final layer on
    the last). torch.distributed.pipelining drives FSDPModule stages itself: gradient sync and
    reshard-after-backward are off for every microbatch but the schedule's final
    REDUCE_GRAD, which reduce-scatters the accumulated gradients once, then divides them by
    the microbatch count. fsdp: ZeRO-3 (or ZeRO-2 with reshard_after_forward=false), HSDP with
    dp_replicate; ddp: the same machinery on replicate_mesh, which is exactly DDP's averaged
    all-reduce (and, unlike wrapping a stage in DistributedDataParallel, also works for the
    split input/weight backward of zero-bubble schedules)."""
    if dims.dp_mode == "none":
        return
    shard_mesh = replicate_mesh(mesh, dims) if dims.dp_mode == "ddp" else None
    for stage in stages:
        apply_fsdp(stage, units_of(stage), mesh, dims, precision=info.precision,
                   reshard_after_forward=cfg.reshard_after_forward, cpu_offload=cfg.cpu_offload,
                   shard_mesh=shard_mesh)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model
