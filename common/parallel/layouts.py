"""The one place that decides whether a parallel layout can run, before any process group.

Two kinds of refusal, both a ConfigError naming the degrees: combinations of mechanisms not built
(or not proved against the single-process run) yet, for every model; and dimensions a model's
plan cannot use, which the model declares as `parallel_limits() -> {dim: reason}`.
"""
from __future__ import annotations

from common.config import ConfigError
from common.parallel.dims import ParallelDims


def not_built(dims: ParallelDims, compile: bool) -> str | None:
    """Why this combination of mechanisms cannot run yet (None: it can)."""
    if dims.pp > 1 and dims.cp > 1:
        return (f"parallel.pp={dims.pp} with parallel.cp={dims.cp} is not supported: context parallelism "
                "shards the token sequence across the whole block stack, which pipeline stages split")
    if dims.pp > 1 and dims.dp_mode != "none":
        return (f"parallel.pp={dims.pp} with data parallelism (dp={dims.dp}, dp_mode={dims.dp_mode}) is not "
                "supported yet: run pipeline parallelism with tp only, or use fsdp without pp")
    if dims.cp > 1 and dims.tp > 1:
        return (f"parallel.cp={dims.cp} with parallel.tp={dims.tp} is not supported yet; use one of them "
                "(with fsdp for the remaining ranks)")
    if dims.pp > 1 and compile:
        return "parallel.compile=true with parallel.pp > 1 is not supported yet"
    return None


def check_layout(dims: ParallelDims, parallel_cfg, limits: dict[str, str], name: str) -> None:
    """Raise ConfigError for the first refused part of the layout. limits: the model's
    parallel_limits(), e.g. {"pp": "stages are not built for this model"}; name: the pipeline
    (or model) named in the message."""
    for dim, reason in limits.items():
        degree = getattr(dims, dim)
        if degree > 1:
            raise ConfigError(f"parallel.{dim}={degree} is not supported for {name}: {reason}")
    why = not_built(dims, parallel_cfg.compile)
    if why:
        raise ConfigError(why)
