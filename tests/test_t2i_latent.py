"""Latent-space training through a diffusers AutoencoderKL given by a local folder (a tiny
random VAE made in the test), and sampling decoded back to pixels."""
from __future__ import annotations

import pytest

import os

import torch

from tests.conftest import read_metrics, run_module, run_train

pytestmark = pytest.mark.slow  # runs the entrypoints in subprocesses


def test_train_and_sample_with_local_vae(synth_data, tmp_path):
    from diffusers import AutoencoderKL
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                        latent_channels=4, norm_num_groups=8, sample_size=32)
    vae_dir = str(tmp_path / "vae")
    vae.save_pretrained(vae_dir)
    run = str(tmp_path / "run")
    run_train(run, synth_data, f"vae.path={vae_dir}", "model.patch_size=2", "train.steps=2", "train.log_every=1")
    metrics = read_metrics(run)
    assert set(metrics) == {1, 2} and all(m["loss"] > 0 for m in metrics.values())
    out = str(tmp_path / "out")
    proc = run_module("pipelines.text2image.sample", "--run", run, "--prompt", "a red star", "--out", out, "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    from PIL import Image
    assert Image.open(os.path.join(out, "00000.png")).size == (32, 32)  # decoded from 16x16x4 latents
    # The word probe scores held-out images through the VAE (its posterior, as training does).
    proc = run_module("pipelines.text2image.eval", "--run", run, "--num", "2", "--steps", "2", "--diversity", "0",
                      "--word-probe", "2")
    assert proc.returncode == 0, proc.stderr
    assert "word probe on 2 held-out real images" in proc.stdout
