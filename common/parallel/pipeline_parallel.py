"""Pipeline parallelism on torch.distributed.pipelining: stage placement, schedules, one train step.

A model family's plan (e.g. common/nn/dit_parallel.py) cuts the model into stage modules (each a view of the model holding
some blocks under the model's own parameter names, so checkpoints stay layout-independent);
this module places stages on ranks, builds the schedule and runs a step.

Placement of the pp * v stages on pp ranks:
  gpipe / 1f1b          v = 1, rank r holds stage r
  interleaved (looped)  rank r holds stages r, r + pp, r + 2 pp, ...
  zero_bubble (ZB-V)    v = 2, rank r holds stages r and 2 pp - 1 - r (the "V": the first rank
                        also holds the last stage, which is what lets ZB-V fill the bubble)
Microbatches: train.grad_accum of them per step, each data.micro_batch_size samples. The schedule
divides gradients by the microbatch count (scale_grads), so a step equals grad_accum micro-steps
of loss / grad_accum in one process.

Composition: a stage module may be an FSDPModule (data parallelism inside the stage; see
common/parallel/data_parallel.py, shard_pipeline_stages). torch's PipelineStage then keeps
gradient sync and reshard-after-backward off for every microbatch and runs FSDP's post-backward
(one reduce-scatter or all-reduce per stage) in the schedule's final REDUCE_GRAD step, before
scale_grads. TP and CP work inside the blocks, so the point-to-point activations between stages
are whatever the blocks produce (CP-sharded tokens when CP is on); the stage groups are the pp
dim of the one mesh, so each (dp, cp, tp) coordinate runs its own pipeline.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleZBVZeroBubble)

_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
              "zero_bubble": ScheduleZBVZeroBubble}


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    if schedule == "zero_bubble":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous, equal runs of layers per stage (ParallelDims.check_model guarantees divisibility)."""
    per = num_layers // num_stages
    return [range(s * per, (s + 1) * per) for s in range(num_stages)]


class PipelineRunner:
    """Runs one optimizer step's forward/backward through the pipeline on this rank's stages."""

    def __init__(self, stages: dict[int, nn.Module], num_stages: int, group, device: torch.device,
                 schedule: str, microbatches: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.stage_ids = sorted(stages)
        self.num_stages = num_stages
        self.has_first = 0 in stages
        self.has_last = num_stages - 1 in stages
        pipe_stages = [PipelineStage(stages[i], i, num_stages, device, group=group) for i in self.stage_ids]
        cls = _SCHEDULES[schedule]
        if schedule in ("gpipe", "1f1b"):
            self.schedule = cls(pipe_stages[0], microbatches, loss_fn=loss_fn, scale_grads=True)
        else:
            self.schedule = cls(pipe_stages, microbatches, loss_fn=loss_fn, scale_grads=True)

    def step(self, inputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor | None:
        """Forward + backward of all microbatches (inputs/target cover the whole step's batch).
        Returns the mean microbatch loss on the rank holding the last stage, else None."""
        losses: list[torch.Tensor] = []
        args = inputs if self.has_first else ()
        kwargs = {"target": target, "losses": losses} if self.has_last else {}
        self.schedule.step(*args, return_outputs=False, **kwargs)
        if not self.has_last:
            return None
        return torch.stack([loss.detach().float() for loss in losses]).mean()
