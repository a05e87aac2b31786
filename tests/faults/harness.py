"""Runs of the text2image train CLI with MMP_FAULT_* injection (common/faults.py), shared by the
tests in this package and by bench/faults.py."""
from __future__ import annotations

import io
import json
import os
import random
import shutil
import subprocess
import tarfile

import torch

from tests.conftest import ROOT, SMALL_MODEL, TINY_YAML, env, read_metrics, train_cmd

# Every step logged and a checkpoint every 2 steps, none deleted: a killed run loses at most one
# step of work and every intermediate checkpoint can be compared with the reference's.
BASE = ["train.log_every=1", "train.ckpt_every=2", "train.keep_last=100", "train.sample_every=0", "sample.num=0"]


def train_args(run_dir: str, data_dir: str, *overrides: str) -> list[str]:
    """The train CLI's arguments of every run here: the small model on `data_dir`, BASE, overrides."""
    return ["--config", TINY_YAML, f"run.dir={run_dir}", f"data.train_shards={data_dir}/train",
            f"data.eval_shards={data_dir}/heldout", *SMALL_MODEL, *BASE, *overrides]


def train(run_dir: str, data_dir: str, *overrides: str, nproc: int = 1, fault_env: dict | None = None,
          timeout: int = 600) -> subprocess.CompletedProcess:
    """The train CLI as users run it (torchrun --standalone for nproc > 1); never raises on failure."""
    cmd = train_cmd(nproc) + train_args(run_dir, data_dir, *overrides)
    e = env()
    e.update(fault_env or {})
    return subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)


def tail(proc: subprocess.CompletedProcess) -> str:
    return f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


def events(run_dir: str, name: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r.get("event") == name]


def random_steps(seed: int, count: int, lo: int, hi: int) -> list[int]:
    """`count` distinct steps in [lo, hi], increasing: each kill comes after the previous resume."""
    return sorted(random.Random(seed).sample(range(lo, hi + 1), count))


def checkpoint_state(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint (model, optimizer, EMA), flattened to dotted keys."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    # Not beside the checkpoint: reference runs are shared by the test workers, read-only.
    fd, tmp = tempfile.mkstemp(suffix=".flat.pt")
    os.close(fd)
    try:
        dcp_to_torch_save(ckpt_dir, tmp)
        state = torch.load(tmp, weights_only=False)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    out = {}

    def walk(prefix, node):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(node, torch.Tensor):
            out[prefix] = node
    walk("", state)
    return out


def same_tensors(a: dict, b: dict) -> list[str]:
    """Keys whose tensors differ in any bit (or exist on one side only)."""
    return sorted(k for k in set(a) | set(b) if k not in a or k not in b or not torch.equal(a[k], b[k]))


def same_losses(ref_run: str, run: str, steps) -> list[int]:
    """Steps whose logged loss or gradient norm differ at all from the reference's."""
    ref, got = read_metrics(ref_run), read_metrics(run)
    return [s for s in steps if (got[s]["loss"], got[s]["grad_norm"]) != (ref[s]["loss"], ref[s]["grad_norm"])]


def kill_and_resume(ref_run: str, run: str, data_dir: str, kill_steps: list[int], steps: int, *overrides: str,
                    nproc: int = 1, kill_rank: int = 0) -> dict:
    """SIGKILL the run at each of `kill_steps` in turn (each attempt resumes the previous one), then
    let it finish; returns what happened, compared with the uninterrupted `ref_run`."""
    killed, resumed_from = 0, []
    for k in kill_steps:
        proc = train(run, data_dir, f"train.steps={steps}", *overrides, nproc=nproc,
                     fault_env={"MMP_FAULT_KILL_AT_STEP": str(k), "MMP_FAULT_KILL_RANK": str(kill_rank)})
        assert f"fault injection: killing rank {kill_rank} at step {k}" in proc.stderr, tail(proc)
        assert proc.returncode != 0, tail(proc)
        killed += 1
    proc = train(run, data_dir, f"train.steps={steps}", *overrides, nproc=nproc)
    assert proc.returncode == 0, tail(proc)
    resumed_from = [e["step"] for e in events(run, "resume")]
    return {"killed": killed, "resumed_from": resumed_from,
            "loss_mismatch": same_losses(ref_run, run, range(1, steps + 1)),
            "weight_mismatch": same_tensors(checkpoint_state(step_dir(ref_run, steps)),
                                            checkpoint_state(step_dir(run, steps)))}


def step_dir(run: str, step: int) -> str:
    return os.path.join(run, "checkpoints", f"step_{step:08d}")


def latest(run: str) -> str:
    with open(os.path.join(run, "checkpoints", "latest")) as f:
        return f.read().strip()


# --------------------------------------------------------------------------- corrupt shards
CORRUPTIONS = ("truncated_png", "garbage_png", "empty_png", "no_caption", "no_image")


def corrupt_copy(src: str, dst: str, every: int, seed: int = 0) -> dict[str, str]:
    """Copy the synthetic dataset `src` (train/, heldout/) to `dst`, corrupting about one train
    sample in `every` (kinds cycle through CORRUPTIONS; which samples, by a seeded RNG); returns
    {key: kind} of the corrupted samples."""
    shutil.copytree(os.path.join(src, "heldout"), os.path.join(dst, "heldout"))
    os.makedirs(os.path.join(dst, "train"))
    rng = random.Random(seed)
    bad: dict[str, str] = {}
    for name in sorted(os.listdir(os.path.join(src, "train"))):
        with tarfile.open(os.path.join(src, "train", name)) as tin, \
                tarfile.open(os.path.join(dst, "train", name), "w") as tout:
            members = [(m, tin.extractfile(m).read()) for m in tin.getmembers() if m.isreg()]
            keys = sorted({m.name.split(".", 1)[0] for m, _ in members})
            chosen = {k for k in keys if rng.random() < 1 / every}
            for k in sorted(chosen):
                bad[k] = CORRUPTIONS[len(bad) % len(CORRUPTIONS)]
            for m, data in members:
                key, ext = m.name.split(".", 1)
                kind = bad.get(key)
                if kind == "no_caption" and ext == "txt" or kind == "no_image" and ext == "png":
                    continue
                if ext == "png" and kind == "truncated_png":
                    data = data[: len(data) // 2]
                elif ext == "png" and kind == "garbage_png":
                    data = bytes(rng.randrange(256) for _ in range(len(data)))
                elif ext == "png" and kind == "empty_png":
                    data = b""
                info = tarfile.TarInfo(m.name)
                info.size, info.mtime = len(data), 0
                tout.addfile(info, io.BytesIO(data))
    return bad


def trained_keys(run: str) -> dict[int, list[str]]:
    """step -> every key trained on in it by all ranks of the last attempt (launch) that ran it."""
    recs = []
    for name in os.listdir(run):
        if name.startswith("keys_rank") and name.endswith(".jsonl"):
            with open(os.path.join(run, name)) as f:
                recs += [json.loads(line) for line in f]
    last: dict[int, tuple[float, str]] = {}
    for r in recs:
        last[r["step"]] = max(last.get(r["step"], (0.0, "")), (r["time"], r["attempt"]))
    steps: dict[int, list[str]] = {}
    for r in recs:
        if r["attempt"] == last[r["step"]][1]:
            steps.setdefault(r["step"], []).extend(r["keys"])
    return steps

