"""ParallelModel: what the trainer needs to know about a model after a pipeline parallelized it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from common.parallel.data_parallel import unwrap
from common.parallel.dims import ParallelDims
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
        return 0 if self.mesh is None else self.mesh["dp"].get_local_rank()

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
