"""The pipeline contract: the dependency rules of DESIGN.md hold, and a new workload costs a spec
(tests/toy_pipeline.py trains, checkpoints, resumes and samples through common/run.py)."""
from __future__ import annotations

import ast
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT, env

TOY = os.path.join(ROOT, "tests", "toy_pipeline.py")


# --------------------------------------------------------------------------- dependency rules
def imports_of(path: str) -> set[str]:
    """Every absolute module a file imports, function-local imports included."""
    tree = ast.parse(open(path).read(), path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def python_files(top: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ROOT, top)) for f in fs if f.endswith(".py")]


def offenders(top: str, forbidden) -> list[str]:
    return sorted(f"{os.path.relpath(p, ROOT)} imports {m}" for p in python_files(top)
                  for m in imports_of(p) if forbidden(p, m))


def test_import_collector_sees_local_and_aliased_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import pipelines.a as x\ndef g():\n    from pipelines.b import c\n")
    assert {"pipelines.a", "pipelines.b", "pipelines.b.c"} <= imports_of(str(f))


def test_common_imports_no_pipeline():
    assert offenders("common", lambda p, m: m.split(".")[0] == "pipelines") == []


def test_data_imports_no_pipeline():
    assert offenders("data", lambda p, m: m.split(".")[0] == "pipelines") == []


def test_no_pipeline_imports_another():
    def other_pipeline(path, module):
        own = os.path.relpath(path, os.path.join(ROOT, "pipelines")).split(os.sep)[0]
        parts = module.split(".")
        return parts[0] == "pipelines" and len(parts) > 1 and parts[1] != own
    assert len(os.listdir(os.path.join(ROOT, "pipelines"))) >= 2
    assert offenders("pipelines", other_pipeline) == []


def test_common_parallel_imports_no_model():
    # Models live in common/nn and pipelines/*/model.py; common/parallel holds mechanisms only.
    assert offenders("common/parallel", lambda p, m: m.split(".")[0] == "pipelines" or m.startswith("common.nn")) == []


# --------------------------------------------------------------------------- a toy pipeline
@pytest.fixture(scope="module")
def vectors(tmp_path_factory):
    """Two shards of 8-d vectors: "up" ones around +1, "down" ones around -1; held-out set apart."""
    import webdataset as wds
    root = tmp_path_factory.mktemp("vectors")
    rng = np.random.default_rng(0)
    for split, shards in (("train", 2), ("heldout", 1)):
        os.makedirs(root / split)
        for s in range(shards):
            with wds.TarWriter(str(root / split / f"{s:06d}.tar")) as w:
                for i in range(32):
                    up = (i + s) % 2 == 0
                    x = (rng.standard_normal(8) * 0.1 + (1 if up else -1)).astype(np.float32)
                    buf = io.BytesIO()
                    np.save(buf, x)
                    w.write({"__key__": f"{s}_{i}", "npy": buf.getvalue(), "txt": "up" if up else "down"})
    return str(root)


def toy(command: str, *args: str, check: bool = True, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, TOY, command, *args], env={**env(), **(extra_env or {})}, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(proc.stderr[-3000:])
    return proc


def toy_train(run: str, data: str, *extra: str, check: bool = True, extra_env: dict | None = None):
    return toy("train", f"run.dir={run}", f"data.train_shards={data}/train", f"data.eval_shards={data}/heldout",
               "data.micro_batch_size=8", "data.num_workers=0", "train.steps=6", "train.log_every=1",
               "train.ckpt_every=2", "train.progress=false", "train.ema_decay=0.9", "optim.lr=1e-2", "sample.num=4",
               "sample.steps=4", *extra,
               check=check, extra_env=extra_env)


def losses(run: str) -> list[float]:
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    return [r["loss"] for r in sorted((r for r in rows if "loss" in r), key=lambda r: r["step"])]


@pytest.mark.slow
def test_toy_spec_trains_resumes_and_samples(vectors, tmp_path):
    whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
    toy_train(whole, vectors)
    ref = losses(whole)
    assert len(ref) == 6 and ref[-1] < ref[0]
    # the in-training sample hook wrote the held-out prompts' samples
    assert np.load(os.path.join(whole, "samples", "step_00000006.npy")).shape == (4, 8)
    assert open(os.path.join(whole, "samples", "step_00000006.txt")).read().split() == ["up", "down", "up", "down"]

    toy_train(resumed, vectors, "train.stop_after=3")  # killed after step 3: checkpoint of step 2 only
    assert sorted(os.listdir(os.path.join(resumed, "checkpoints"))) == ["latest", "step_00000002"]
    toy_train(resumed, vectors)
    assert losses(resumed)[-4:] == ref[-4:]  # bit for bit after the resume

    out = str(tmp_path / "out")
    toy("sample", "--run", whole, "--prompt", "up", "--out", out, "--num", "3", "--steps", "8")
    index = [json.loads(line) for line in open(os.path.join(out, "index.jsonl"))]
    assert [(r["file"], r["prompt"], r["seed"], r["steps"]) for r in index] == \
        [(f"{i:05d}.npy", "up", i, 8) for i in range(3)]
    grid = np.load(os.path.join(out, "grid.npy"))
    assert grid.shape == (3, 8) and np.array_equal(grid[1], np.load(os.path.join(out, "00001.npy")))


def test_one_process_asking_for_fsdp_gets_it(vectors, tmp_path):
    """dp_mode=fsdp by name in one process (mixed precision or CPU offload on one GPU, a one-rank
    smoke run) shards over a one-rank mesh and trains exactly as the plain process does."""
    plain, fsdp = str(tmp_path / "plain"), str(tmp_path / "fsdp")
    toy_train(plain, vectors, "train.steps=3")
    proc = toy_train(fsdp, vectors, "train.steps=3", "parallel.dp_mode=fsdp")
    assert "dp_mode=fsdp" in proc.stdout
    assert losses(fsdp) == losses(plain)


@pytest.mark.slow
def test_profiled_steps_are_written_and_train_as_unprofiled_ones(vectors, tmp_path):
    plain, profiled = str(tmp_path / "plain"), str(tmp_path / "profiled")
    toy_train(plain, vectors, "train.steps=4")
    proc = toy_train(profiled, vectors, "train.steps=4", "train.profile_at=2", "train.profile_count=2")
    assert losses(profiled) == losses(plain)
    events = [json.loads(line) for line in open(os.path.join(profiled, "metrics.jsonl"))]
    [event] = [e for e in events if e.get("event") == "profile"]
    assert event["steps"] == [2, 3] and event["clock"] == "cpu"
    assert 0 < event["busy_ms_per_step"] < event["wall_ms_per_step"]
    table = open(os.path.join(profiled, "profile", "rank0.txt")).read()
    assert "aten::addmm" in table and "aten::addmm" in [name for name, _ in event["top_ms_per_step"]]
    assert os.path.getsize(os.path.join(profiled, "profile", "rank0.json.gz")) > 0
    # deterministic algorithms are on, but torch.empty is not NaN-filled (one fill_ per empty before)
    calls = {line.split()[0]: int(line.split()[-1]) for line in table.splitlines() if line.strip().startswith("aten::")}
    assert calls["aten::fill_"] < calls["aten::empty"], calls
    assert "profile of steps 2-3" in proc.stdout
    proc = toy_train(str(tmp_path / "bad"), vectors, "train.profile_count=0", check=False)
    assert proc.returncode == 2 and "train.profile_count=0 must be > 0" in proc.stderr


def test_input_frac_is_the_share_of_time_spent_on_inputs(vectors, tmp_path):
    """A rank that sleeps 0.3 s while it waits for its batches in every step (as a starved loader
    would) spends nearly all of a tiny model's step there, and is told so once, after the first
    window (start-up) and naming the loader, not the preparation."""
    run = str(tmp_path / "slow")
    proc = toy_train(run, vectors, "train.steps=3",
                     extra_env={"MMP_FAULT_SLOW_RANK": "0", "MMP_FAULT_SLOW_S": "0.3"})
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    lines = [r for r in rows if "input_frac" in r and "event" not in r]
    assert len(lines) == 3 and all(0.9 < r["input_frac"] <= 1.0 for r in lines), lines
    assert all(r["fetch_frac"] > 0.9 and r["prepare_frac"] < 0.1 for r in lines), lines
    assert all(abs(r["fetch_frac"] + r["prepare_frac"] - r["input_frac"]) < 1e-9 for r in lines)
    [event] = [r for r in rows if r.get("event") == "input_bound"]
    assert event["step"] == 2 and event["fetch_frac"] > 0.9, event
    assert "waiting for the loader" in proc.stdout and "data.num_workers=0" in proc.stdout, proc.stdout[-2000:]
    proc = toy_train(str(tmp_path / "bad"), vectors, "train.input_warn_frac=1.5", check=False)
    assert proc.returncode == 2 and "train.input_warn_frac=1.5 must be in [0, 1]" in proc.stderr


def test_training_reduces_host_values_only_through_the_device_aware_helpers(vectors, tmp_path):
    """Two ranks of the toy pipeline with a straggler report every step and the automatic
    checkpoint interval (a max over ranks): every collective our code issues comes from
    common.dist's helpers, which put host values and the gradient norm's sum on the device the
    backend takes (NCCL: the GPU); and the sums are right."""
    from tests.conftest import run_checked, train_cmd
    run = str(tmp_path / "run")
    args = [f"run.dir={run}", f"data.train_shards={vectors}/train", f"data.eval_shards={vectors}/heldout",
            "data.micro_batch_size=4", "data.num_workers=0", "train.steps=4", "train.log_every=1",
            "train.ckpt_every=auto", "train.straggler_every=1", "train.progress=false", "sample.num=0"]
    proc = run_checked(train_cmd(2, "tests.collective_audit") + args, timeout=300)
    for rank in range(2):
        callers = json.load(open(os.path.join(run, f"collectives_rank{rank}.json")))
        assert set(callers) == {"common.dist:all_reduce_tensor", "common.dist:all_gather_floats"}, callers
        assert callers["common.dist:all_gather_floats"] == 4, callers  # the straggler reports
        # totals, grad norms, the interval, and whether a stop signal came during the last save
        assert callers["common.dist:all_reduce_tensor"] == 4 + 4 + 1 + 1, callers
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["samples_seen"] for r in rows if "loss" in r] == [8, 16, 24, 32], proc.stdout[-2000:]
    assert any(r.get("event") == "ckpt_interval" for r in rows), rows


def test_input_wait_names_the_part_that_starves_the_step():
    from common.metrics import InputWait
    wait = InputWait(0.25, repeat=2)
    wait.add(0.1, 0.5)  # window 1: start-up, not judged
    fields, event, message = wait.end_window(1.0, 10, num_workers=4)
    assert event is None and message is None and fields["prepare_frac"] == 0.5
    wait.add(0.05, 0.45)
    fields, event, message = wait.end_window(1.0, 20, num_workers=4)
    assert event == {"event": "input_bound", "step": 20, **fields} and fields["input_frac"] == 0.5
    assert "preparing batches" in message and "data.precompute" in message
    wait.add(0.3, 0.0)
    assert wait.end_window(1.0, 30, num_workers=4)[1] is None  # repeated at most every 2 windows
    wait.add(0.3, 0.0)
    _, event, message = wait.end_window(1.0, 40, num_workers=4)
    assert event["step"] == 40 and "data.num_workers=4" in message
    wait.add(0.1, 0.1)
    wait.end_window(1.0, 50, num_workers=4)
    wait.add(0.1, 0.1)  # under the threshold
    assert wait.end_window(1.0, 60, num_workers=4)[1] is None
    off = InputWait(0.0)
    for step in (1, 2, 3):
        off.add(1.0, 0.0)
        assert off.end_window(1.0, step, num_workers=0)[1] is None


@pytest.mark.slow
def test_relaunch_with_another_model_keeps_the_run_config(vectors, tmp_path):
    run = str(tmp_path / "run")
    toy_train(run, vectors, "train.steps=2")
    before = open(os.path.join(run, "config.yaml")).read()
    proc = toy_train(run, vectors, "train.steps=4", "dim=16", check=False)
    assert proc.returncode == 2 and "written for another model" in proc.stderr, proc.stderr[-2000:]
    assert open(os.path.join(run, "config.yaml")).read() == before
    proc = toy_train(run, vectors, "train.steps=4", "dim=16", "run.resume=none", check=False)
    assert proc.returncode == 2 and "written for another model" in proc.stderr, proc.stderr[-2000:]
    assert open(os.path.join(run, "config.yaml")).read() == before


def test_toy_refuses_layouts_it_has_no_plan_for():
    import torch

    from common.config import ConfigError, ParallelConfig
    from common.dist import DistInfo
    sys.path.insert(0, os.path.dirname(TOY))
    from toy_pipeline import SPEC, Denoiser
    info = DistInfo(0, 2, 0, torch.device("cpu"))
    with pytest.raises(ConfigError, match="parallel.tp=2 is not supported for toy"):
        SPEC.parallelize(Denoiser(8), ParallelConfig(tp=2), info, name=SPEC.name)
