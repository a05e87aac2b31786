"""The lent-GPU check script and its wheel list, on a machine without a GPU.

bench/gpu_check.sh must skip every CUDA step cleanly ("no CUDA") and exit 0, and with
GPU_CHECK_CPU_DRYRUN=1 run the tiny CPU variant of the training benchmark, so the code path that
spends the GPU's minutes is exercised here first. bench/gpu_wheels.sh --list must never ask to carry
what the GPU image already has (torch, triton, numpy above all).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGE_LIST = os.path.join(ROOT, "bench", "gpu_image_packages.txt")
CUDA_STEPS = ("env", "tests", "kernels", "smoke", "lowp")
VARIANTS = ("bf16", "compile", "fp8_tensorwise", "fp8_rowwise")

needs_bash = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils timeout")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _image_packages() -> dict[str, str | None]:
    out = {}
    for line in open(IMAGE_LIST):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, version = line.partition("==")
        out[_norm(name)] = version or None
    return out


@needs_bash
@pytest.mark.slow  # ~40-60 s: four variants of the tiny DiT (compiled with aot_eager), 8 profiled train steps
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour (a GPU runs the real steps)")
def test_gpu_check_cpu_dry_run(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, GPU_CHECK_CPU_DRYRUN="1", OUT=str(out), GPU_CHECK_PYTHON=sys.executable)
    for k in ("GPU_CHECK_CPU_SMOKE", "GPU_CHECK_TOTAL_S", "MMP_KERNEL_BACKEND"):
        env.pop(k, None)
    proc = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_check.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=480)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail

    report = json.loads((out / "gpu_check.json").read_text())
    assert report["mode"] == "cpu-dryrun"
    steps = report["steps"]
    assert set(steps) == {"wheels", *CUDA_STEPS, "train", "profile"}, steps.keys()
    for name in CUDA_STEPS:
        assert steps[name]["status"] == "skipped" and "no CUDA" in steps[name]["reason"], (name, steps[name])
    assert steps["wheels"]["status"] in ("ok", "skipped"), steps["wheels"]
    assert steps["train"]["status"] == "ok" and "no CUDA" in steps["train"]["reason"], steps["train"]

    bench = json.loads((out / "gpu_train_bench.json").read_text())
    assert bench["complete"] and bench["size"] == "tiny"
    rows = {r["variant"]: r for r in bench["variants"]}
    assert set(rows) == set(VARIANTS)
    for name, r in rows.items():
        if r["status"] == "ok":
            assert r["steps_per_s"] > 0 and r["samples_per_s"] > 0 and r["batch"] >= 1, r
        else:  # fp8 without its module (or torchao): skipped, saying why
            assert r["status"] == "skipped" and r.get("reason"), r
    assert rows["bf16"]["status"] == "ok" and rows["compile"]["status"] == "ok"
    # the per-variant profile (--profile-steps): categories add up to the total, and GEMMs are seen
    prof = rows["bf16"]["profile"]
    assert prof["total_ms"] > 0 and abs(sum(prof["by_category_ms"].values()) - prof["total_ms"]) < 0.05 * prof["total_ms"]
    assert prof["by_category_ms"].get("gemm", 0) > 0 and prof["top"], prof
    assert rows["compile"]["ratio_to_bf16"] > 0
    assert bench["flops_source"].startswith("DiT.flops_per_sample")

    # step 6 on the tiny config: the real train CLI with steps 5-7 under torch.profiler
    assert steps["profile"]["status"] == "ok", steps["profile"]
    data = steps["profile"]["data"]
    assert data["samples_per_s"] > 0 and 0 < data["input_frac"] < 1, data
    assert 0 < data["busy_ms_per_step"] < data["wall_ms_per_step"], data
    assert "aten::addmm" in [name for name, _ in data["top_ms_per_step"]] or \
        "aten::mm" in [name for name, _ in data["top_ms_per_step"]], data["top_ms_per_step"]
    assert "Self CPU" in (out / "profile_rank0.txt").read_text()

    # the summary table: a header and one row per step, with its status
    text = proc.stdout
    assert "gpu_check summary (cpu-dryrun" in text, tail
    table = text[text.index("gpu_check summary"):]
    for name, s in steps.items():
        assert re.search(rf"^{name}\s+{s['status']}\s+\d+", table, re.M), (name, table)
    assert (out / "gpu_check.log").read_text().count("gpu_check summary") == 1


def test_gpu_image_package_list_parses():
    text = open(IMAGE_LIST).read()
    header = [ln for ln in text.splitlines() if ln.startswith("#")]
    assert any("2026-11-17" in ln for ln in header) and any("KINDS.md" in ln for ln in header)
    names = [ln.strip().partition("==")[0] for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert len(names) == len(set(names)), "duplicate package names"
    assert all(re.fullmatch(r"[a-z0-9][a-z0-9-]*", n) for n in names), [n for n in names if not re.fullmatch(r"[a-z0-9-]+", n)]
    pkgs = _image_packages()
    assert len(pkgs) > 150
    assert pkgs["torch"] == "2.11.0" and pkgs["triton"] == "3.6.0" and pkgs["numpy"] == "2.5.2"
    for missing in ("omegaconf", "open-clip-torch", "webdataset", "torchao", "diffusers"):
        assert missing not in pkgs


@needs_bash
def test_gpu_wheels_list_excludes_the_image():
    proc = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_wheels.sh"), "--list"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    needed = dict(line.split("==") for line in proc.stdout.split())
    names = {_norm(n) for n in needed}
    assert not names & {"torch", "triton", "numpy", "torchvision"}, names
    assert not names & set(_image_packages()), names & set(_image_packages())
    assert {"omegaconf", "open-clip-torch", "webdataset", "torchao"} <= names
    lock = {}
    for line in open(os.path.join(ROOT, "requirements.lock")):
        if "==" in line and not line.startswith("#"):
            n, v = line.strip().split("==")
            lock[_norm(n)] = v
    for n, v in needed.items():
        assert lock.get(_norm(n)) == v, (n, v, lock.get(_norm(n)))
