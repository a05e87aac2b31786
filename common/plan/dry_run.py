"""Dry run of a layout at full size: the real DeviceMesh of N ranks on torch's fake process
group, the real model on the meta device, parallelized by the pipeline's own plan exactly as
training would (TP, CP, activation checkpointing, pipeline stages, FSDP2), one rank at a time.

Nothing is allocated and nothing is sent: the fake group answers every collective at once and
meta tensors carry shapes only. What it proves: the layout divides (the same ConfigError a real
start would raise), which parameters a rank holds and with which local shapes, and which ranks
each of its process groups contains. torch.distributed.pipelining's PipelineStage is constructed
(it is what the schedule drives); its first-step shape inference needs real sends and a forward, so
the schedule itself is not run (the fake group would hand back uninitialised tensors). DDP
without pipelining is the one wrapper left out (see _ddp_as_identity).
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F

from common.parallel.dims import submesh
from common.plan.layout import Layout, rank_param_numel

GROUP_DIMS = {"pp": ("pp",), "dp_replicate": ("dp_replicate",), "dp_shard": ("dp_shard",), "cp": ("cp",),
              "tp": ("tp",), "fsdp (dp_shard x cp)": ("dp_shard", "cp"),
              "dp (loader split)": ("dp_replicate", "dp_shard")}
MESH_NAMES = {"fsdp (dp_shard x cp)": "dp_shard_cp", "dp (loader split)": "dp"}


def parallel_config(lay: Layout, base=None):
    from dataclasses import replace

    from common.config import ParallelConfig
    cfg = base if base is not None else ParallelConfig()
    return replace(cfg, dp_mode=lay.dp_mode, dp_replicate=lay.dp_replicate, dp_shard=lay.dp_shard, tp=lay.tp,
                   cp=lay.cp, cp_mode=lay.cp_mode, pp=lay.pp, pp_schedule=lay.schedule,
                   pp_stages_per_rank=lay.stages_per_rank if lay.pp > 1 else 0, activation_checkpoint=lay.ac,
                   ac_every=lay.ac_every, sequence_parallel=lay.sequence_parallel,
                   reshard_after_forward=lay.reshard_after_forward, compile=False, cpu_offload=False)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _ranks_text(ranks: list[int], limit: int = 8) -> str:
    if len(ranks) <= limit:
        return str(ranks)
    return f"[{', '.join(map(str, ranks[:limit - 2]))}, ..., {ranks[-2]}, {ranks[-1]}] ({len(ranks)} ranks)"


def parallelize_rank(source, lay: Layout, rank: int):
    """Initialise the fake group as `rank` of lay.world and parallelize the meta model; returns
    the ParallelModel. The caller destroys the process group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from common.dist import DistInfo
    from common.precision.policy import PrecisionPolicy
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=lay.world, store=FakeStore())
    info = DistInfo(rank, lay.world, rank % 8, torch.device("cpu"), PrecisionPolicy(compute_dtype=torch.bfloat16))
    base = getattr(source.cfg, "parallel", None)
    pcfg = parallel_config(lay, base)
    model = source.build_model()
    with _ddp_as_identity(lay):
        if source.llama_cfg is not None:
            from common.nn.vlm_parallel import parallelize_vlm
            return parallelize_vlm(model, pcfg, info, microbatches=lay.microbatches, criterion=F.cross_entropy,
                                   name=source.desc.name)
        return source.spec.parallelize(model, pcfg, info, microbatches=lay.microbatches, criterion=F.mse_loss,
                                       name=source.spec.name)


@contextlib.contextmanager
def _ddp_as_identity(lay: Layout):
    """DDP without pipelining wraps the whole model in DistributedDataParallel, whose constructor
    checks parameter shapes across ranks and broadcasts rank 0's weights: value reads that meta
    tensors cannot answer. Its parameters are the module's own, whole on every rank, so the dry run
    leaves the wrapper out (PP x DDP goes through FSDP2 on a replicate mesh and is built for real)."""
    if lay.dp_mode != "ddp" or lay.pp > 1:
        yield
        return
    from unittest import mock
    with mock.patch("common.parallel.data_parallel.apply_ddp", lambda model, mesh, device: model):
        yield


def inspect_rank(source, lay: Layout, rank: int, n_params: int = 4) -> dict:
    """Parallelize as `rank` and report what it holds and its groups."""
    import torch.distributed as dist
    t0 = time.perf_counter()
    try:
        pm = parallelize_rank(source, lay, rank)
        mesh = pm.mesh
        params = list(pm.module.named_parameters())
        local = sum(_local(p).numel() for _, p in params)
        shown = []
        picks = [i for i in (0, 1, len(params) // 2, len(params) - 1) if 0 <= i < len(params)]
        for i in dict.fromkeys(picks[:n_params]):
            name, p = params[i]
            placements = ",".join(str(x) for x in getattr(p, "placements", ())) or "plain"
            shown.append((name, tuple(p.shape), tuple(_local(p).shape), placements))
        groups = {}
        for label, dims in GROUP_DIMS.items():
            if all(getattr(lay, d) == 1 for d in dims) or mesh is None:
                continue
            got = submesh(mesh, MESH_NAMES.get(label, dims[0])).mesh.flatten().tolist()
            groups[label] = (got, got == lay.group_ranks(rank, dims))
        stages = sorted(pm.pipeline.stage_ids) if pm.pipeline is not None else [0]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {"rank": rank, "coords": lay.coords(rank), "stages": stages, "params": shown, "local_numel": local,
            "planned_numel": rank_param_numel(source.desc, lay, rank), "groups": groups,
            "seconds": time.perf_counter() - t0}


def sample_ranks(lay: Layout) -> list[int]:
    """First rank, the last pipeline stage's last rank and one in the middle of the mesh."""
    w = lay.world
    return sorted({0, w // 2 + lay.tp // 2 + (1 if lay.cp > 1 else 0) * lay.tp, w - 1})


def dry_run(source, lay: Layout, ranks=None, out=print) -> list[dict]:
    from common.plan.layout import memory
    ranks = sample_ranks(lay) if ranks is None else ranks
    out(f"dry run: {source.desc.name}, {lay.world} ranks = pp {lay.pp} x dp_replicate {lay.dp_replicate} x "
        f"dp_shard {lay.dp_shard} x cp {lay.cp} ({lay.cp_mode}) x tp {lay.tp}, {lay.dp_mode}, "
        f"{lay.schedule} x {lay.microbatches} microbatches of {lay.micro_batch}, AC {lay.ac}; fake process group, "
        "meta-device model")
    reports = []
    for r in ranks:
        rep = inspect_rank(source, lay, r)
        reports.append(rep)
        c = rep["coords"]
        mem = memory(source.desc, lay, c["pp"], ema=source.ema)
        out(f"rank {r}: coords {' '.join(f'{k}={v}' for k, v in c.items())}, pipeline stage(s) {rep['stages']}, "
            f"parallelized in {rep['seconds']:.1f} s")
        ok = "equal to the plan" if rep["local_numel"] == rep["planned_numel"] else \
            f"PLAN SAYS {rep['planned_numel']:,}"
        n = rep["local_numel"]
        out(f"  parameters held: {n:,} elements ({ok}): fp32 params {4 * n / 2**20:.1f} MiB, grads "
            f"{4 * n / 2**20:.1f} MiB, AdamW{' + EMA' if source.ema else ''} "
            f"{(12 if source.ema else 8) * n / 2**20:.1f} MiB; planned for the stage: activations "
            f"{mem['activations'] / 2**30:.2f} GiB, buffers {mem['buffers'] / 2**30:.2f} GiB, total "
            f"{mem['total'] / 2**30:.2f} GiB")
        for name, gshape, lshape, pl in rep["params"]:
            out(f"  {name}: global {list(gshape)} -> local {list(lshape)} [{pl}]")
        for label, (ranks_, same) in rep["groups"].items():
            out(f"  {label:<22} {_ranks_text(ranks_)}{'' if same else '  (differs from the plan!)'}")
    return reports
