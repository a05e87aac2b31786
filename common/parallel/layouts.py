"""The one place that decides whether a parallel layout can run, before any process group.

Two kinds of refusal, both a one-line ConfigError naming the degrees: combinations of mechanisms
not built (or not proved against the single-process run) yet, for every model; and dimensions a
model's plan cannot use, which the model declares as `parallel_limits() -> {dim: reason}`.
A third: options that would do nothing in the layout (FSDP's without FSDP), so a user never
believes a setting is in effect that is not. Layouts that do not divide (heads, tokens, layers,
microbatches) are ParallelDims.check_model's.

Composed and proved (tests/test_parallel_grid.py, tests/test_vlm_parallel.py: loss and grad norm
per step and final weights equal to one process at rtol 1e-5, gloo, 2 to 8 ranks):
  PP x FSDP2 (ZeRO-3, ZeRO-2, HSDP)  each stage's blocks, then the stage, fully_shard-ed; the
                                     schedule syncs gradients once per step (after the last
                                     microbatch's backward), so the reduced gradient is the mean of
                                     the same per-sample terms as one process
  PP x DDP                           the stage replicated through FSDP2 on a (dp, 1) mesh: DDP's
                                     averaged all-reduce, also valid for split (zero-bubble) backward
  PP x TP, PP x CP                   TP/CP act inside blocks; CP shards tokens at block 0 and gathers
                                     before the final layer, whichever stage holds them (stage
                                     boundaries carry the CP-sharded tokens)
  CP x TP (+SP)                      CP shards the sequence first, TP/SP splits each CP shard
  PP x DP x CP x TP                  the above on one mesh (proved at 16 ranks, every degree 2)
  compile with PP                    per-block compile; the stages call the compiled blocks
"""
from __future__ import annotations

from common.config import ConfigError
from common.parallel.dims import ParallelDims


def not_built(dims: ParallelDims, compile: bool, cpu_offload: bool = False) -> str | None:
    """Why this combination of mechanisms cannot run yet (None: it can)."""
    if dims.pp > 1 and cpu_offload:
        return (f"parallel.cpu_offload=true with parallel.pp={dims.pp} is not supported yet: offloaded FSDP "
                "shards inside pipeline stages are not proved; use cpu_offload=false or pp=1")
    return None


def check_layout(dims: ParallelDims, parallel_cfg, limits: dict[str, str], name: str) -> None:
    """Raise ConfigError for the first refused part of the layout. limits: the model's
    parallel_limits(), e.g. {"pp": "stages are not built for this model"}; name: the pipeline
    (or model) named in the message."""
    for dim, reason in limits.items():
        degree = getattr(dims, dim)
        if degree > 1:
            raise ConfigError(f"parallel.{dim}={degree} is not supported for {name}: {reason}")
    why = not_built(dims, parallel_cfg.compile, getattr(parallel_cfg, "cpu_offload", False))
    if why:
        raise ConfigError(why)
    why = ineffective(dims, parallel_cfg)
    if why:
        raise ConfigError(why)


def ineffective(dims: ParallelDims, parallel_cfg) -> str | None:
    """Why an option set away from its default would do nothing in this layout (None: none would).
    FSDP's options act only on sharded units: under DDP (also PP x DDP, whose stages sit on a
    shard group of one) or no data parallelism, nothing is sharded, offloaded or resharded."""
    if dims.dp_mode == "fsdp":
        return None
    for key, value, default in (("cpu_offload", getattr(parallel_cfg, "cpu_offload", False), False),
                                ("reshard_after_forward", getattr(parallel_cfg, "reshard_after_forward", True), True)):
        if value != default:
            return (f"parallel.{key}={str(value).lower()} does nothing in the layout {dims.describe}: "
                    f"it is an FSDP option; set parallel.dp_mode=fsdp or leave {key}={str(default).lower()}")
    return None
