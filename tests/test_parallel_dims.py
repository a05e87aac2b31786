"""ParallelDims: degrees resolved against the world size, and every bad layout refused at start
with a message naming the numbers (never a hang or a shape error mid-training)."""
from __future__ import annotations

import pytest

from common.config import ConfigError, ParallelConfig
from common.dist import DistInfo
from common.parallel.dims import ParallelDims
from common.parallel.pipeline_parallel import split_layers, stage_ids
from tests.conftest import run_train


def dims(world: int, **kw) -> ParallelDims:
    return ParallelDims.from_config(ParallelConfig(**kw), world)


def test_dp_shard_fills_the_world_and_modes_resolve():
    d = dims(8, tp=2, cp=2)
    assert (d.dp_shard, d.dp, d.dp_mode) == (2, 2, "fsdp")
    assert dims(4).dp_mode == "ddp" and dims(1).dp_mode == "none"
    assert dims(2, tp=2).dp_mode == "none"  # nothing replicated, nothing to reduce
    assert dims(4, dp_replicate=2).dp_mode == "fsdp"  # HSDP 2 x 2
    h = dims(4, cp=4, cp_mode="hybrid", cp_ulysses=2)
    assert (h.cp_ulysses, h.dp_mode) == (2, "fsdp")
    assert dims(2, pp=2, pp_schedule="interleaved").pp_stages_per_rank == 2
    assert dims(4, pp=2, dp_mode="ddp").dp_mode == "ddp"  # each stage replicated over dp=2
    assert dims(4, pp=2).dp_mode == "fsdp"  # auto: stages sharded over dp=2


@pytest.mark.parametrize("world,kw,words", [
    (4, dict(tp=3), ["tp=3", "world size 4"]),
    (4, dict(dp_shard=3), ["dp_shard=3", "world size 4", "product is 3"]),
    (2, dict(dp_mode="ddp", tp=2), ["dp_mode=ddp", "tp=2", "fsdp"]),
    (2, dict(dp_mode="none"), ["dp_mode=none", "reduced"]),
    (4, dict(cp=4, cp_mode="hybrid", cp_ulysses=4), ["hybrid", "cp=4", "cp_ulysses=4"]),
    (2, dict(cp=2, cp_mode="ringg"), ["cp_mode='ringg'"]),
    (2, dict(pp=2, pp_schedule="zero_bubble", pp_stages_per_rank=3), ["zero_bubble", "3"]),
    (2, dict(pp=2, pp_schedule="1f1b", pp_stages_per_rank=2), ["1f1b", "interleaved"]),
    (4, dict(dp_replicate=4, dp_mode="fsdp"), ["dp_replicate=4", "shards nothing"]),
])
def test_bad_degrees_are_refused_with_the_numbers(world, kw, words):
    with pytest.raises(ConfigError) as e:
        dims(world, **kw)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("world,kw,model,words", [
    (2, dict(tp=2), dict(heads=3), ["tp=2", "3 attention heads"]),
    (2, dict(cp=2, cp_mode="ulysses"), dict(heads=3), ["Ulysses degree 2", "3 heads"]),
    (2, dict(cp=2, cp_mode="ring"), dict(heads=3, seq_len=63), ["cp=2", "63 tokens"]),
    (2, dict(tp=2), dict(heads=4, seq_len=63), ["tp=2", "63 tokens"]),
    (2, dict(pp=2), dict(heads=2, layers=3), ["pp=2", "3 blocks"]),
    (2, dict(pp=2, pp_schedule="interleaved"), dict(heads=2, layers=2), ["4 pipeline stages", "2 blocks"]),
    (2, dict(pp=2), dict(heads=2, layers=4, microbatches=3), ["grad_accum=3", "pipeline degree (2)"]),
])
def test_model_dependent_checks(world, kw, model, words):
    with pytest.raises(ConfigError) as e:
        dims(world, **kw).check_model(**model)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("kw,words", [
    (dict(pp=2, dp_shard=2, cpu_offload=True), ["cpu_offload=true", "pp=2", "not supported"]),
])
def test_unsupported_combinations_fail_before_any_process_group(kw, words):
    """The combination check runs before the mesh is built, so it needs no processes."""
    import torch

    from pipelines.text2image.model import DiT, dit_config
    from common.nn.dit_parallel import parallelize_dit as parallelize
    model = DiT(dit_config("tiny", hidden=32, depth=4, heads=4))
    info = DistInfo(0, 4, 0, torch.device("cpu"))
    with pytest.raises(ConfigError) as e:
        parallelize(model, ParallelConfig(**kw), info, microbatches=2)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("world,kw", [
    (4, dict(pp=2, dp_shard=2)), (4, dict(pp=2, dp_mode="ddp")), (4, dict(pp=2, cp=2)), (4, dict(cp=2, tp=2)),
    (2, dict(pp=2, compile=True)), (16, dict(pp=2, dp_shard=2, cp=2, tp=2)),
])
def test_composed_layouts_are_accepted(world, kw):
    """Once refused, now built and proved in tests/test_parallel_grid.py."""
    from common.parallel.layouts import not_built
    cfg = ParallelConfig(**kw)
    d = ParallelDims.from_config(cfg, world)
    assert not_built(d, cfg.compile, cfg.cpu_offload) is None


def test_stage_placement():
    assert stage_ids(0, 2, 1, "1f1b") == [0] and stage_ids(1, 2, 1, "1f1b") == [1]
    assert stage_ids(0, 2, 2, "interleaved") == [0, 2] and stage_ids(1, 2, 2, "interleaved") == [1, 3]
    assert stage_ids(0, 2, 2, "zero_bubble") == [0, 3] and stage_ids(1, 2, 2, "zero_bubble") == [1, 2]
    assert [list(r) for r in split_layers(4, 2)] == [[0, 1], [2, 3]]


def test_entrypoint_refuses_a_layout_that_does_not_fit(synth_data, tmp_path):
    proc = run_train(str(tmp_path / "run"), synth_data, "parallel.tp=2", check=False)
    assert proc.returncode == 2
    assert "error: parallel degrees" in proc.stderr and "world size 1" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
