"""The pipeline contract: what a workload declares so that the shared entrypoints (common/run.py)
can train it, checkpoint it, sample from it and evaluate it. The shared code consumes specs and
never names a pipeline; a new workload costs a spec, a model and a decoder (pipelines/README.md).

`build(cfg)` returns the run's components: any object with
  cfg     the resolved config (a dataclass with the common sections run, data, optim, train,
          parallel and a `sample` section with steps, cfg, num, seed)
  model   the trainable nn.Module
  frozen  {name: nn.Module} of frozen modules saved in checkpoints (e.g. the text tower)
  to(device)  moves everything the step functions and the sampler use
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

# An extra sample.py option: (flags, argparse keyword arguments); its value reaches write_item and
# write_grid in `options` under the argparse dest, and generate as a keyword when the dest is
# listed in generate_options.
Option = tuple[tuple[str, ...], dict]


@dataclass(frozen=True)
class PipelineSpec:
    name: str                    # the package under pipelines/, shown in messages and --help
    description: str             # one line for --help
    config: type                 # the config dataclass (validate() is called when it is parsed)
    build: Callable[[Any], Any]  # cfg -> components (seeded apart from the global RNG)
    # (components, device) -> (prepare(batch) -> (inputs, target), criterion(pred, target) -> loss)
    step_fns: Callable[[Any, torch.device], tuple[Callable, Callable]]
    # (model, parallel_cfg, info, *, microbatches, criterion, name) -> common.parallel.ParallelModel;
    # refuses the layouts the model does not support (common.parallel.layouts)
    parallelize: Callable[..., Any]
    decoder: Callable[[Any], Callable[[dict], dict]]  # components -> picklable shard-sample decoder
    signature: Callable[[Any], dict]  # components -> what a checkpoint must match to load
    # The generative side, used by run.sample / run.evaluate and the in-training sample grids;
    # a pipeline with its own sample/eval commands (vlm) leaves them None and sets sample_hook.
    # (components, model, prompts, seeds, *, steps, guidance, device, **options) -> media (N, ...)
    generate: Callable[..., torch.Tensor] | None = None
    # (media, stem, components, options) -> written paths: every sample of a call in one file set
    write_grid: Callable[[torch.Tensor, str, Any, dict], list[str]] | None = None
    # (one item of media, stem, components, options) -> ({index field: file name}, {extra index fields})
    write_item: Callable[[torch.Tensor, str, Any, dict], tuple[dict, dict]] | None = None
    describe: Callable[[Any], str] = lambda comp: type(comp.model).__name__  # start-up line
    flops: Callable[[Any, tuple], float] | None = None  # (components, inputs) -> forward FLOPs of a micro-batch
    bucket_tokens: Callable[[Any], Callable] | None = None  # components -> (shape -> tokens) for buckets
    sample_options: tuple[Option, ...] = field(default_factory=tuple)
    generate_options: tuple[str, ...] = ()  # dests of sample_options that generate takes
    media_noun: str = "samples"  # what sample.py says it wrote ("images", "clips")
    collate: Callable[[Any], Callable | None] | None = None  # components -> loader collate (None: stack)
    init: Callable[[Any], None] | None = None  # components -> None: weights from elsewhere before training
    # (components, model, step, dist info) -> None: replaces the generate/write_grid sample point
    sample_hook: Callable[[Any, torch.nn.Module, int, Any], None] | None = None
