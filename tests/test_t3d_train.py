"""text23d end to end through the real entrypoints: each stage trains, writes turntables during
training, samples PLY files and evaluates; exact resume; corrupt samples skipped and counted."""
from __future__ import annotations

import io
import json
import os
import sys

import numpy as np
import pytest
import webdataset as wds

from common.data.pointclouds import read_ply
from tests.conftest import ROOT, assert_same_training, read_metrics, run_checked, train_cmd

CONFIGS = os.path.join(ROOT, "pipelines/text23d/configs")
# Models small enough that a handful of steps takes seconds on 2 cores.
SMALL = ["model.hidden=32", "model.depth=2", "model.heads=2", "model.points=64",
         "text.width=32", "text.layers=1", "text.heads=2", "text.context_length=16",
         "vae.width=32", "vae.heads=2", "vae.latents=16", "vae.latent_dim=4", "vae.dec_layers=1",
         "vae.surface_points=128", "vae.queries=64", "vae.mesh_resolution=16",
         "sample.steps=2", "sample.num=3", "train.progress=false", "data.num_workers=0",
         "train.log_every=1", "optim.warmup_steps=2"]


def run_t3d(config: str, run_dir: str, data_dir: str, *overrides: str, nproc: int = 1, check: bool = True):
    return run_checked(train_cmd(nproc, "pipelines.text23d.train") + [
        "--config", os.path.join(CONFIGS, config), f"run.dir={run_dir}", f"data.train_shards={data_dir}/train",
        f"data.eval_shards={data_dir}/heldout", *SMALL, *overrides], check=check)


def run_tool(module: str, *args: str):
    return run_checked([sys.executable, "-m", module, *args])


@pytest.fixture(scope="module")
def points_run(synth3d_data, tmp_path_factory):
    run = str(tmp_path_factory.mktemp("t3d") / "points")
    run_t3d("tiny_points.yaml", run, synth3d_data, "train.steps=6", "train.ckpt_every=3", "train.sample_every=6")
    return run


def test_points_stage_trains_samples_and_evaluates(points_run, synth3d_data, tmp_path):
    metrics = read_metrics(points_run)
    assert sorted(metrics) == list(range(1, 7))
    assert all(np.isfinite(m["loss"]) for m in metrics.values())
    assert metrics[6]["loss"] < metrics[1]["loss"]  # six steps of a flow on 3 channels learn something
    for ext in ("png", "gif", "txt"):
        assert os.path.isfile(os.path.join(points_run, "samples", f"step_00000006.{ext}"))

    out = str(tmp_path / "samples")
    proc = run_tool("pipelines.text23d.sample", "--run", points_run, "--prompt", "a red cube", "--num", "2",
                    "--out", out, "--steps", "2")
    assert "wrote 2 shapes" in proc.stdout
    index = [json.loads(line) for line in open(os.path.join(out, "index.jsonl"))]
    assert [r["seed"] for r in index] == [0, 1] and all(r["prompt"] == "a red cube" for r in index)
    xyz, rgb, faces = read_ply(os.path.join(out, index[0]["file"]))
    assert xyz.shape == (64, 3) and rgb.shape == (64, 3) and faces is None
    assert os.path.isfile(os.path.join(out, "grid.png")) and os.path.isfile(os.path.join(out, "grid.gif"))

    proc = run_tool("pipelines.text23d.eval", "--run", points_run, "--num", "7", "--steps", "2")
    assert "shape accuracy" in proc.stdout and "Chamfer" in proc.stdout
    result = json.load(open(os.path.join(points_run, "eval.json")))
    r = result["samples"]
    assert r["n"] == 7 and 0 <= r["shape_acc"] <= 1 and r["chamfer"] > r["floor_chamfer"] > 0
    assert result["step"] == 6


def test_points_stage_resumes_bit_for_bit(points_run, synth3d_data, tmp_path):
    run = str(tmp_path / "resumed")
    run_t3d("tiny_points.yaml", run, synth3d_data, "train.steps=6", "train.ckpt_every=3", "train.sample_every=6",
            "train.stop_after=3")
    assert max(read_metrics(run)) == 3
    run_t3d("tiny_points.yaml", run, synth3d_data, "train.steps=6", "train.ckpt_every=3", "train.sample_every=6")
    assert_same_training(points_run, run, range(1, 7))
    for s in range(1, 7):  # not only close: identical
        assert read_metrics(run)[s]["loss"] == read_metrics(points_run)[s]["loss"]


@pytest.mark.slow  # ~40 s: two trainings, three evals with marching cubes
def test_vae_then_latent_stage(synth3d_data, tmp_path):
    vae_run, latent_run = str(tmp_path / "vae"), str(tmp_path / "latent")
    run_t3d("tiny_vae.yaml", vae_run, synth3d_data, "train.steps=8", "train.sample_every=8")
    losses = [m["loss"] for m in read_metrics(vae_run).values()]
    assert losses[-1] < losses[0]
    assert os.path.isfile(os.path.join(vae_run, "samples", "step_00000008.gif"))
    proc = run_tool("pipelines.text23d.eval", "--run", vae_run, "--num", "4")
    assert "VAE reconstructions of 4 held-out shapes" in proc.stdout and "occupancy IoU" in proc.stdout
    assert 0 <= json.load(open(os.path.join(vae_run, "eval.json")))["reconstruction"]["iou"] <= 1

    proc = run_t3d("tiny_latent.yaml", latent_run, synth3d_data, f"vae.run={vae_run}", "train.steps=4",
                   "train.sample_every=4")
    assert "stage latent" in proc.stdout and "16 latents" in proc.stdout
    proc = run_tool("pipelines.text23d.eval", "--run", latent_run, "--num", "3", "--steps", "2")
    assert "samples of 3 held-out captions" in proc.stdout and "VAE reconstructions" in proc.stdout
    out = str(tmp_path / "meshes")
    run_tool("pipelines.text23d.sample", "--run", latent_run, "--prompt", "a blue sphere", "--out", out,
             "--steps", "2")
    row = json.loads(open(os.path.join(out, "index.jsonl")).readline())
    if "mesh" in row:  # an untrained field may have no surface at all; when it has one, it is a mesh
        xyz, rgb, faces = read_ply(os.path.join(out, row["mesh"]))
        assert faces is not None and len(faces) == row["faces"]


def test_latent_stage_refuses_a_run_that_is_not_a_vae(points_run, synth3d_data, tmp_path):
    proc = run_t3d("tiny_latent.yaml", str(tmp_path / "latent"), synth3d_data, f"vae.run={points_run}",
                   check=False)
    assert proc.returncode == 2
    assert "must be a stage=vae run" in proc.stderr and "Traceback" not in proc.stderr


def _npy(a) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def test_bad_samples_are_skipped_and_counted(synth3d_data, tmp_path):
    """A shard of good samples with bad ones among them: training runs on and counts each."""
    import glob
    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    good = [s for src in sorted(glob.glob(f"{synth3d_data}/train/*.tar"))[:1] for s in wds.WebDataset(src, shardshuffle=False)]
    bad = {"nan": np.full((512, 6), np.nan, np.float16), "no-colour": np.zeros((512, 3), np.float16)}
    with wds.TarWriter(str(data / "train" / "shard-000000.tar")) as w:
        for i, s in enumerate(good):
            w.write({k: v for k, v in s.items() if not k.startswith("__") or k == "__key__"})
            if i in (3, 9):
                kind = "nan" if i == 3 else "no-colour"
                w.write({"__key__": f"bad{i}", "npy": _npy(bad[kind]), "txt": b"a red cube"})
    os.symlink(os.path.join(synth3d_data, "heldout"), data / "heldout")
    run = str(tmp_path / "run")
    proc = run_t3d("tiny_points.yaml", run, str(data), "train.steps=3", "data.micro_batch_size=16",
                   "train.sample_every=0", "sample.num=0")
    assert "corrupt samples 2" in proc.stdout
    assert "NaN" in proc.stderr + proc.stdout and "missing colour" in proc.stderr + proc.stdout
