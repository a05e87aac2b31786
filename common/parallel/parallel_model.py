"""ParallelModel: what the trainer needs to know about a model after a pipeline parallelized it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from common.parallel.data_parallel import apply_data_parallel, unwrap
from common.parallel.dims import ParallelDims, submesh
from common.parallel.layouts import check_layout
from common.parallel.pipeline_parallel import PipelineRunner


@dataclass
class ParallelModel:
    # This rank's parameters under the full model's names (checkpoints, optimizer, EMA). Without
    # pipeline parallelism it is also what a forward calls (possibly DDP/FSDP wrapped).
    module: torch.nn.Module
    dims: ParallelDims
    mesh: object = None
    pipeline: PipelineRunner | None = None
    # Run after backward and before clipping, once per optimizer step (e.g. summing the partial
    # gradients of TP-replicated parameters that saw only this rank's heads or tokens).
    grad_hooks: list[Callable[[], None]] = field(default_factory=list)

    @property
    def dp_rank(self) -> int:
        return 0 if self.mesh is None else submesh(self.mesh, "dp").get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def ranks_per_stage(self) -> int:
        return self.dims.world_size // self.dims.pp

    @property
    def holds_loss(self) -> bool:
        return self.pipeline is None or self.pipeline.has_last

    @property
    def can_sample(self) -> bool:
        return self.pipeline is None

    @property
    def plain(self) -> torch.nn.Module:
        return unwrap(self.module)

    def forward(self, *inputs):
        if self.pipeline is not None:
            raise RuntimeError("a pipeline-parallel model runs through ParallelModel.pipeline.step")
        return self.module(*inputs)


def parallelize_data_only(model: torch.nn.Module, cfg, info, *, microbatches: int = 1, criterion=None,
                          name: str | None = None, units=()) -> ParallelModel:
    """The parallelize of a model with no tensor, context or pipeline plan: DDP or FSDP (with
    `units` as the sharding units) over every rank; tp/cp/pp > 1 are refused by name."""
    dims = ParallelDims.from_config(cfg, info.world_size)
    no_plan = "the model has no plan for it (data parallelism only)"
    check_layout(dims, cfg, {"tp": no_plan, "cp": no_plan, "pp": no_plan}, name or type(model).__name__)
    mesh = dims.build_mesh(info.device.type)
    return ParallelModel(apply_data_parallel(model, units, mesh, dims, info, cfg), dims, mesh)
