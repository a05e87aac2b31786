"""text2image end to end on the small synthetic set: run-dir contents, sample/eval CLIs, exact
resume after a kill, corrupt samples, non-finite guard (bad input: tests/faults/test_bad_input.py)."""
from __future__ import annotations

import pytest

import json
import math
import os

import webdataset as wds

from tests.conftest import read_metrics, run_module, run_train

pytestmark = pytest.mark.slow  # runs the entrypoints in subprocesses


def _one_line_error(proc, needle: str) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr.strip()
    assert "Traceback" not in err and err.count("\n") == 0, err[-3000:]
    assert err.startswith("error:") and needle in err, err


def test_run_dir_layout_and_sample_eval_clis(synth_data, tmp_path):
    run = str(tmp_path / "run")
    run_train(run, synth_data, "train.steps=6", "train.ckpt_every=3", "train.log_every=1")
    for path in ("config.yaml", "metrics.jsonl", "checkpoints/latest", "checkpoints/step_00000006/meta.json",
                 "samples/step_00000006.png"):
        assert os.path.exists(os.path.join(run, path)), path
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(run, "tb")))
    metrics = read_metrics(run)
    assert sorted(metrics) == [1, 2, 3, 4, 5, 6]
    for rec in metrics.values():
        assert {"loss", "lr", "grad_norm", "samples_per_s"} <= set(rec)
        assert rec["loss"] > 0 and rec["samples_per_s"] > 0

    out = str(tmp_path / "samples")
    proc = run_module("pipelines.text2image.sample", "--run", run, "--prompt", "a red circle", "--num", "3",
                      "--out", out, "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    index = [json.loads(line) for line in open(os.path.join(out, "index.jsonl"))]
    assert [r["seed"] for r in index] == [0, 1, 2] and {r["prompt"] for r in index} == {"a red circle"}
    assert all(os.path.isfile(os.path.join(out, r["file"])) for r in index)
    assert os.path.isfile(os.path.join(out, "grid.png"))

    proc = run_module("pipelines.text2image.eval", "--run", run, "--num", "4", "--steps", "2", "--word-probe", "3")
    assert proc.returncode == 0, proc.stderr
    result = json.load(open(os.path.join(run, "eval.json")))
    assert result["n"] == 4 and "colour accuracy" in proc.stdout
    # The word probe on the real model (its figures are checked with oracles in test_word_probe.py).
    assert result["word_probe"]["n"] == 3 and "word probe on 3 held-out real images" in proc.stdout
    assert all(0 <= result["word_probe"][w]["accuracy"] <= 1 for w in ("shape", "colour"))
    # Diversity beside accuracy: 8 samples of "a COLOUR SHAPE" per held-out class over the class's
    # real spread (data.shape_analysis.diversity_ratio, checked there).
    assert result["diversity"]["samples_per_prompt"] == 8 and "diversity at guidance" in proc.stdout
    assert all(n >= 2 for n in result["diversity"]["real_per_class"].values())
    assert result["diversity"]["ratio"] > 0
    # The figures are those of the analyser on what sample.py draws for the same held-out captions
    # and seeds (0..3), against those samples' own attributes.
    import numpy as np
    from PIL import Image

    from common.data.captions import first_examples
    from data.shape_analysis import score
    examples = first_examples(os.path.join(synth_data, "heldout"), 4)
    prompts = tmp_path / "heldout.txt"
    prompts.write_text("".join(c + "\n" for c, _ in examples))
    out = str(tmp_path / "heldout_samples")
    proc = run_module("pipelines.text2image.sample", "--run", run, "--prompts", str(prompts), "--out", out,
                      "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    index = [json.loads(line) for line in open(os.path.join(out, "index.jsonl"))]
    images = np.stack([np.asarray(Image.open(os.path.join(out, r["file"])).convert("RGB")) for r in index])
    expected = score(images, [a for _, a in examples])
    assert {k: result[k] for k in expected} == expected, (result, expected)

    # An earlier checkpoint by --checkpoint, recorded as such in a file of its own: the latest's
    # eval.json is kept.
    latest_eval = open(os.path.join(run, "eval.json")).read()
    earlier = os.path.join(run, "checkpoints", "step_00000003")
    proc = run_module("pipelines.text2image.eval", "--run", run, "--checkpoint", earlier, "--num", "2", "--steps",
                      "2", "--diversity", "0")
    assert proc.returncode == 0, proc.stderr
    result = json.load(open(os.path.join(run, "eval_step_00000003.json")))
    assert result["step"] == 3 and os.path.samefile(result["checkpoint"], earlier) and "(step 3)" in proc.stdout
    assert "eval_step_00000003.json" in proc.stdout
    assert open(os.path.join(run, "eval.json")).read() == latest_eval


def test_resume_after_kill_is_bitwise_identical(synth_data, tmp_path):
    full, killed = str(tmp_path / "full"), str(tmp_path / "killed")
    common = ["train.steps=8", "train.ckpt_every=3", "train.log_every=1", "train.sample_every=0"]
    run_train(full, synth_data, *common)
    # Killed right after step 5: the newest complete checkpoint is step 3. Workers on, to show
    # that worker prefetch does not change what a resumed run sees.
    run_train(killed, synth_data, *common, "train.stop_after=5", "data.num_workers=2")
    assert not os.path.exists(os.path.join(killed, "checkpoints", "step_00000006"))
    assert open(os.path.join(killed, "checkpoints", "latest")).read().strip() == "step_00000003"
    with open(os.path.join(killed, "metrics.jsonl"), "a") as f:
        f.write('{"step": 6, "lo')  # as a kill in the middle of a line's write leaves it
    run_train(killed, synth_data, *common, "run.resume=auto", "data.num_workers=2")
    # One timeline: steps 4 and 5, logged before the kill and again after the resume, and the torn
    # line are set aside, not lost.
    with open(os.path.join(killed, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 9))
    with open(os.path.join(killed, "metrics.abandoned.jsonl")) as f:
        aside = f.read().splitlines()
    moved = [json.loads(line) for line in aside[:-1]]  # events of those steps too (e.g. input_bound, by timing)
    assert [r["step"] for r in moved if "loss" in r] == [4, 5] and all(r["step"] > 3 for r in moved), aside
    assert aside[-1] == '{"step": 6, "lo', aside
    a, b = read_metrics(full), read_metrics(killed)
    for step in range(4, 9):
        assert a[step]["loss"] == b[step]["loss"], (step, a[step]["loss"], b[step]["loss"])
        assert a[step]["grad_norm"] == b[step]["grad_norm"], step
    assert any(json.loads(line).get("event") == "resume" for line in open(os.path.join(killed, "metrics.jsonl")))


def test_corrupt_image_is_skipped_and_counted(synth_data, tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    src = wds.WebDataset(os.path.join(synth_data, "train", "shard-000000.tar"), shardshuffle=False)
    with wds.TarWriter(str(shards / "shard-000000.tar")) as sink:
        for i, s in enumerate(src):
            if i == 8:
                break
            sample = {"__key__": s["__key__"], "png": s["png"], "txt": s["txt"]}
            if i == 3:
                sample["png"] = s["png"][:40]  # truncated image
            sink.write(sample)
    run = str(tmp_path / "run")
    run_train(run, synth_data, f"data.train_shards={shards}", "data.micro_batch_size=8", "train.steps=3",
              "train.log_every=1")
    metrics = read_metrics(run)
    # Each step is one full epoch of 8 samples, one of them corrupt.
    assert [metrics[s]["corrupt_samples"] for s in (1, 2, 3)] == [1, 2, 3]


def test_non_finite_steps_are_skipped_then_stop_the_run(synth_data, tmp_path):
    run = str(tmp_path / "run")
    proc = run_train(run, synth_data, "optim.lr=1e30", "optim.warmup_steps=0", "optim.grad_clip=0",
                     "train.steps=40", "train.max_bad_steps=3", "train.log_every=1", check=False)
    _one_line_error(proc, "non-finite")
    skipped = [r["skipped_steps"] for r in read_metrics(run).values()]
    assert max(skipped) >= 2  # logged skips before the third one stopped the run


def test_ddpm_objective_with_v_prediction_trains(synth_data, tmp_path):
    run = str(tmp_path / "run")
    run_train(run, synth_data, "diffusion.objective=ddpm", "diffusion.ddpm_prediction=v", "train.steps=3",
              "train.log_every=1")
    losses = [m["loss"] for m in read_metrics(run).values()]
    assert len(losses) == 3
    # The untrained DiT predicts 0 (zero final layer), so step 1's loss is the mean square of the
    # first global batch's v targets: sqrt(abar) eps - sqrt(1 - abar) x0 (an eps target differs).
    from common.config import from_yaml_file
    from common.diffusion.noise import SALT_NOISE, per_sample_randn, sample_seeds
    from common.run import make_loader
    from pipelines.text2image.spec import SPEC
    cfg = from_yaml_file(SPEC.config, os.path.join(run, "config.yaml"))
    comp = SPEC.build(cfg)
    batch = next(iter(make_loader(SPEC, comp, cfg, dp_rank=0, dp_size=1)))
    x0, seeds = batch["image"], sample_seeds(cfg.run.seed, batch["__position__"])
    eps = per_sample_randn(seeds, x0.shape[1:], SALT_NOISE)
    a, s = comp.objective.coefs(comp.objective.sample_t(seeds), x0)
    v_loss, eps_loss = (a * eps - s * x0).pow(2).mean().item(), eps.pow(2).mean().item()
    assert losses[0] == pytest.approx(v_loss, rel=1e-5) and abs(v_loss - eps_loss) > 1e-2, (losses, v_loss, eps_loss)
    assert all(math.isfinite(v) for v in losses)
    assert os.path.isfile(os.path.join(run, "samples", "step_00000003.png"))  # DDIM sampling ran


def test_diversity_scan_is_bounded_when_a_class_is_rare(monkeypatch):
    """A held-out class that never reaches REAL_PER_CLASS images must not make the eval read the
    whole split: the scan stops at MAX_SCANNED samples and uses the real images it found."""
    import argparse
    import io
    import types

    import numpy as np
    import torch
    from PIL import Image

    from pipelines.text2image import eval as t2i_eval

    def png(seed):
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(seed).integers(0, 256, (4, 4, 3), dtype=np.uint8)).save(buf, "PNG")
        return buf.getvalue()

    read = []

    def samples(_shards):  # only red circles: the blue square of the examples never appears
        for i in range(100):
            read.append(i)
            yield {"png": png(i), "json": json.dumps({"colour": "red", "shape": "circle"}).encode()}

    monkeypatch.setattr(t2i_eval, "iter_samples", samples)
    monkeypatch.setattr(t2i_eval, "MAX_SCANNED", 10)
    generate = lambda comp, model, prompts, seeds, **kw: torch.from_numpy(  # noqa: E731
        np.random.default_rng(1).integers(0, 256, (len(prompts), 4, 4, 3), dtype=np.uint8))
    monkeypatch.setattr(t2i_eval, "SPEC", types.SimpleNamespace(generate=generate))
    args = argparse.Namespace(diversity=3, diversity_classes=2, shards="unused", seed=0)
    examples = [("a red circle", {"colour": "red", "shape": "circle"}),
                ("a blue square", {"colour": "blue", "shape": "square"})]
    result = {"steps": 2, "cfg": 3.0}
    lines = t2i_eval.diversity(args, types.SimpleNamespace(model=None), examples, result)
    assert len(read) <= 11  # not all 100
    assert result["diversity"]["real_per_class"] == {"red circle": 10}
    assert "1 classes" in lines[0]
