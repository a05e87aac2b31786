"""Shared fixtures: a small synthetic dataset made once per session, and helpers that run the
text2image entrypoints as users do: `python -m ...` and `torchrun --standalone ...` command lines,
each process forked from a warm server with the imports done (tests/forked_runs.py; FORKED_RUNS=0
starts real processes).

Reference runs that many tests read go through `shared_once`: made once per session even under
pytest-xdist, where each worker would otherwise make its own."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import pytest

from tests import forked_runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_YAML = os.path.join(ROOT, "pipelines/text2image/configs/tiny.yaml")

# A model small enough that a handful of steps takes seconds on 2 cores.
SMALL_MODEL = ["model.hidden=32", "model.depth=2", "model.heads=2", "model.patch_size=4",
               "text.width=32", "text.layers=1", "text.heads=2", "text.context_length=16",
               "sample.steps=2", "sample.num=4", "train.progress=false", "data.num_workers=0"]


def shared_once(tmp_path_factory, name: str, build) -> str:
    """The directory `name`, filled by build(path) once per test session and then only read.
    Under pytest-xdist the workers' temp dirs share a parent: the first worker to get the file
    lock builds it there and the others wait for it. A build that failed is redone."""
    import shutil

    from filelock import FileLock
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    path, done = root / f"shared-{name}", root / f"shared-{name}.done"
    with FileLock(str(root / f"shared-{name}.lock")):
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            build(str(path))
            done.touch()
    return str(path)


@pytest.fixture(scope="session")
def synth_data(tmp_path_factory):
    from data.synth import generate
    return shared_once(tmp_path_factory, "synth", lambda out: generate(
        out, count=256, heldout_count=32, size=32, shard_size=32, seed=0, progress=False))


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_NUM_THREADS"] = "1"  # two ranks on two cores; also makes runs comparable
    return e


def train_cmd(nproc: int = 1, module: str = "pipelines.text2image.train") -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", module]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", module]


def run_checked(cmd: list[str], timeout: int = 600, check: bool = True) -> subprocess.CompletedProcess:
    """Run an entrypoint as users do (repo root, PYTHONPATH, one thread), forked from a warm
    process when it is `python -m` or `torchrun --standalone` (tests/forked_runs.py);
    AssertionError with the output's tail when it fails and `check`."""
    proc = forked_runs.run(cmd, env(), ROOT, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-5000:]}")
    return proc


def run_train(run_dir: str, data_dir: str, *overrides: str, nproc: int = 1, check: bool = True,
              timeout: int = 600) -> subprocess.CompletedProcess:
    args = train_cmd(nproc) + ["--config", TINY_YAML, f"run.dir={run_dir}",
                               f"data.train_shards={data_dir}/train", f"data.eval_shards={data_dir}/heldout",
                               *SMALL_MODEL, *overrides]
    return run_checked(args, timeout, check)


def run_module(module: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return forked_runs.run([sys.executable, "-m", module, *args], env(), ROOT, timeout)


def wait_until(proc: subprocess.Popen, ready, timeout: float = 240) -> None:
    """Poll until ready() or the process ended (its assertions then say why)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not ready():
        time.sleep(0.1)


def read_metrics(run_dir: str) -> dict[int, dict]:
    """step -> the record logged for it (a resumed run sets its earlier copies aside, common/metrics.py)."""
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "step" in rec and "loss" in rec:
                out[rec["step"]] = rec
    return out


def final_weights(spec, run: str, step: int, use_ema: bool = False) -> dict:
    """The run's final checkpoint loaded in one process (every shard gathered by DCP): the trained
    weights, or with use_ema its EMA weights (what sample and eval use)."""
    from common.run import load_run
    comp, meta = load_run(spec, run, use_ema=use_ema)
    assert meta["step"] == step
    return {k: v.clone() for k, v in comp.model.state_dict().items()}


def assert_same_final_weights(spec, ref_run: str, run: str, step: int, prefix: str = "") -> None:
    """The final trained and EMA weights of `run` equal `ref_run`'s (rtol 1e-5, atol 1e-6), over the
    same parameter names (some of them starting with `prefix`)."""
    import torch
    for use_ema in (False, True):
        ref, got = final_weights(spec, ref_run, step, use_ema), final_weights(spec, run, step, use_ema)
        assert ref.keys() == got.keys() and any(k.startswith(prefix) for k in ref)
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6,
                                       msg=f"{'EMA ' if use_ema else ''}{name}")


def assert_same_training(ref_run: str, run: str, steps) -> None:
    """Per-step loss and gradient norm of `run` equal those of `ref_run` (rtol 1e-5)."""
    ref, par = read_metrics(ref_run), read_metrics(run)
    for step in steps:
        assert par[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5), (step, par[step], ref[step])
        assert par[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-5), (step, par[step], ref[step])


def assert_same_losses_to_rounding(ref_run: str, run: str, steps, rel: float = 1e-4) -> None:
    """`run` logged exactly `steps`, each step's loss within `rel` of `ref_run`'s, and not all
    bitwise equal: the runs took different roundings of the same inputs (features stored in
    float16 against the tower's), so a run that ignored its stored inputs fails here."""
    ref, got = read_metrics(ref_run), read_metrics(run)
    assert sorted(ref) == sorted(got) == list(steps)
    for step in steps:
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=rel), step
    assert any(got[s]["loss"] != ref[s]["loss"] for s in steps)


def file_tree(d: str) -> dict[str, bytes]:
    """{relative path: bytes} of every file under d (byte-identity checks of generated datasets)."""
    out = {}
    for p in sorted(glob.glob(os.path.join(d, "**", "*"), recursive=True)):
        if os.path.isfile(p):
            with open(p, "rb") as f:
                out[os.path.relpath(p, d)] = f.read()
    return out


@pytest.fixture(scope="session")
def vqa_data(tmp_path_factory):
    """A small synthetic VQA set (data.synth --vqa): train/ and heldout/ shards of 48 px images."""
    from data.synth_vqa import generate_vqa
    return shared_once(tmp_path_factory, "vqa", lambda out: generate_vqa(
        out, count=192, heldout_count=32, shard_size=64, seed=0))


@pytest.fixture(scope="session")
def synth3d_data(tmp_path_factory):
    """A small synthetic 3-D set (data.synth --3d): train/ and heldout/ shards of coloured
    primitives with 512 surface points and 256 occupancy queries each."""
    from data.synth_3d import generate_3d
    return shared_once(tmp_path_factory, "synth3d", lambda out: generate_3d(
        out, count=128, heldout_count=16, points=512, occupancy=256, shard_size=32, seed=0))

