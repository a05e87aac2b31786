"""text2video in the latent space of a frozen diffusers video VAE given by a local folder (tiny
random VAEs made in the tests): the VideoVae wrapper (shapes, frame-count rule, exact inversion
of the normalisation) for a causal AutoencoderKLWan and a frame-wise AutoencoderKL (fast), config
errors (fast), and end to end: 2 latent-space training steps and sample.py writing a pixel mp4
(slow, subprocesses)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from common.config import ConfigError, build_config
from tests.conftest import ROOT, env, read_metrics, run_module

TINY_YAML = os.path.join(ROOT, "pipelines/text2video/configs/tiny.yaml")
# 5 pixel frames of 32 px -> Wan latents 2 x 4 x 4 (4 ch); patches 1 x 2 x 2 -> 2 x 2 x 2 = 8 tokens.
LATENT_MODEL = ["model.frames=5", "model.image_size=32", "model.patch_size=2", "model.temporal_patch=1",
                "model.hidden=32", "model.depth=2", "model.heads=2", "text.width=32", "text.layers=1",
                "text.heads=2", "text.context_length=16", "sample.steps=2", "sample.num=2", "sample.scale=1",
                "train.progress=false", "data.num_workers=0"]
WAN_MEAN, WAN_STD = [0.1, -0.2, 0.3, 0.0], [1.5, 0.5, 2.0, 1.0]


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    from diffusers import AutoencoderKLWan
    torch.manual_seed(0)
    # Smallest Wan layout that keeps the real factors (4 blocks: 8x space, temporal_downsample
    # [False, True, True]: 4x time) with few channels: ~62k params.
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           latents_mean=WAN_MEAN, latents_std=WAN_STD)
    out = str(tmp_path_factory.mktemp("wan_vae"))
    vae.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def image_vae_dir(tmp_path_factory):
    from diffusers import AutoencoderKL
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                        latent_channels=4, norm_num_groups=8, sample_size=32, scaling_factor=0.7, shift_factor=0.05)
    out = str(tmp_path_factory.mktemp("image_vae"))
    vae.save_pretrained(out)
    return out


def _clip(b, t, h=32, w=32):
    return torch.rand(b, 3, t, h, w, generator=torch.Generator().manual_seed(t)) * 2 - 1


# --------------------------------------------------------------------------- fast
def test_wan_wrapper_shapes_frame_rule_and_exact_normalisation(wan_dir):
    from pipelines.text2video.vae import VideoVae
    v = VideoVae(wan_dir)  # kind=auto from config.json
    assert (v.kind, v.latent_channels, v.spatial_factor, v.temporal_factor) == ("wan", 4, 8, 4)
    assert v.latent_shape(5, 32, 32) == (4, 2, 4, 4) and v.latent_shape(1, 16, 24) == (4, 1, 2, 3)
    assert v.latent_shape(129, 720, 1280) == (4, 33, 90, 160)
    for bad in ((8, 32, 32), (6, 32, 32), (5, 30, 32)):
        with pytest.raises(ConfigError):
            v.latent_shape(*bad)
    x = _clip(2, 5)
    z = v.encode(x)
    assert tuple(z.shape) == (2, *v.latent_shape(5, 32, 32))
    raw = v.vae.encode(x).latent_dist.mode()  # the posterior mean: deterministic
    mean, std = torch.tensor(WAN_MEAN).view(1, 4, 1, 1, 1), torch.tensor(WAN_STD).view(1, 4, 1, 1, 1)
    torch.testing.assert_close(z, (raw - mean) / std, rtol=1e-5, atol=1e-6)  # the Wan pipeline's normalisation
    torch.testing.assert_close(v.encode(x), z, rtol=0, atol=0)
    y = v.decode(z)
    assert tuple(y.shape) == tuple(x.shape)
    with torch.no_grad():
        ref = v.vae.decode(raw).sample
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)  # the scale is inverted exactly
    # An explicit scalar scale replaces 1/std, keeps the mean.
    v2 = VideoVae(wan_dir, "wan", scaling_factor=0.5)
    torch.testing.assert_close(v2.encode(x), (raw - mean) * 0.5, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v2.decode(v2.encode(x)), ref, rtol=1e-5, atol=1e-5)


def test_framewise_image_vae_wrapper(image_vae_dir):
    from pipelines.text2video.vae import VideoVae
    v = VideoVae(image_vae_dir)
    assert (v.kind, v.latent_channels, v.spatial_factor, v.temporal_factor) == ("image", 4, 2, 1)
    assert v.latent_shape(3, 32, 32) == (4, 3, 16, 16)  # any frame count: time folded into the batch
    x = _clip(2, 3)
    z = v.encode(x)
    assert tuple(z.shape) == (2, 4, 3, 16, 16)
    frame1 = v.vae.encode(x[:, :, 1]).latent_dist.mode()  # frame-wise = the image VAE on each frame
    torch.testing.assert_close(z[:, :, 1], (frame1 - 0.05) * 0.7, rtol=1e-5, atol=1e-5)
    y = v.decode(z)
    assert tuple(y.shape) == tuple(x.shape)
    with torch.no_grad():
        ref1 = v.vae.decode(frame1).sample
    torch.testing.assert_close(y[:, :, 1], ref1, rtol=1e-5, atol=1e-5)


def test_cogvideox_wrapper_odd_latent_frames(tmp_path):
    from diffusers import AutoencoderKLCogVideoX

    from pipelines.text2video.vae import VideoVae
    torch.manual_seed(0)
    AutoencoderKLCogVideoX(block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1, norm_num_groups=4,
                           sample_height=32, sample_width=32, scaling_factor=0.9).save_pretrained(str(tmp_path))
    v = VideoVae(str(tmp_path))
    assert (v.kind, v.latent_channels, v.spatial_factor, v.temporal_factor) == ("cogvideox", 4, 8, 4)
    assert v.latent_shape(9, 32, 32) == (4, 3, 4, 4) and v.latent_shape(49, 32, 32)[1] == 13
    with pytest.raises(ConfigError, match="odd number of latent frames"):
        v.latent_shape(5, 32, 32)  # 2 latent frames would decode to 8 frames
    x = _clip(1, 9)
    z = v.encode(x)
    assert tuple(z.shape) == (1, 4, 3, 4, 4)
    raw = v.vae.encode(x).latent_dist.mode()
    torch.testing.assert_close(z, raw * 0.9, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        ref = v.vae.decode(raw).sample
    y = v.decode(z)
    assert tuple(y.shape) == tuple(x.shape)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_components_build_latent_model_prepare_and_generate(wan_dir):
    from pipelines.text2video import components
    from pipelines.text2video.config import T2VConfig
    cfg = build_config(T2VConfig, TINY_YAML, LATENT_MODEL + [f"vae.path={wan_dir}"])
    comp = components.build(cfg)
    mc = comp.model.cfg
    assert (mc.in_channels, mc.frames, mc.height, mc.width) == (4, 2, 4, 4) and mc.num_tokens == 8
    assert comp.pixel_clip_shape == (5, 32, 32)
    assert comp.clip_tokens((5, 32, 32)) == 8 and comp.clip_tokens((1, 32, 32)) == 4  # pixel bucket -> tokens
    sig = components.signature(cfg, comp)
    assert sig["vae"]["class"] == "AutoencoderKLWan" and sig["vae"]["latent_shape"] == [4, 2, 4, 4]
    assert json.loads(json.dumps(sig)) == sig  # stored in meta.json and compared after a round trip
    assert "vae" not in components.signature(cfg, components.build(build_config(T2VConfig, TINY_YAML, [])))
    prepare, criterion = components.make_step_fns(comp, torch.device("cpu"))
    batch = {"video": _clip(2, 5), "caption": ["a", "b"], "__position__": torch.tensor([0, 1])}
    (x_t, t, ctx, mask), target = prepare(batch)
    assert x_t.shape == target.shape == (2, 4, 2, 4, 4)
    (x2, _, _, _), _ = prepare(batch)
    assert torch.equal(x_t, x2)
    assert torch.isfinite(criterion(comp.model(x_t, t, ctx, mask), target))
    image = {"video": _clip(2, 1), "caption": ["a", "b"], "__position__": torch.tensor([2, 3])}  # a [1, h, w] bucket
    assert prepare(image)[0][0].shape == (2, 4, 1, 4, 4)
    clips = components.generate(comp, comp.model, ["a red circle"], [0], steps=1, guidance=1.0)
    assert clips.shape == (1, 5, 32, 32, 3) and clips.dtype == torch.uint8
    assert components.generate(comp, comp.model, ["x"], [0], steps=1, guidance=1.0, frames=9).shape == (1, 9, 32, 32, 3)
    with pytest.raises(ConfigError, match="1 \\+ k\\*4"):
        components.generate(comp, comp.model, ["x"], [0], steps=1, guidance=1.0, frames=8)


@pytest.mark.parametrize("overrides, match", [
    (["vae.path=/nonexistent/vae"], "not a directory"),
    (["model.frames=8"], "1 \\+ k\\*4"),
    (["model.image_size=36"], "spatial factor 8"),
    (["model.in_channels=16"], "latent channels"),
    (["data.buckets=[[1,32,32],[4,32,32]]"], "data.buckets"),
    (["vae.kind=cogvideox"], "cannot load"),
])
def test_latent_config_errors_at_build(wan_dir, overrides, match):
    from pipelines.text2video import components
    from pipelines.text2video.config import T2VConfig
    cfg = build_config(T2VConfig, TINY_YAML, LATENT_MODEL + [f"vae.path={wan_dir}"] + overrides)  # parses
    with pytest.raises(ConfigError, match=match):
        components.build(cfg)


def test_unknown_vae_class_is_a_config_error(tmp_path):
    from pipelines.text2video.vae import VideoVae
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "AutoencoderTiny"}))
    with pytest.raises(ConfigError, match="unsupported VAE class"):
        VideoVae(str(tmp_path))


@pytest.mark.parametrize("name", ["tiny", "base", "xl"])
def test_shipped_t2v_configs_parse(name):
    from pipelines.text2video.config import T2VConfig
    cfg = build_config(T2VConfig, os.path.join(ROOT, f"pipelines/text2video/configs/{name}.yaml"), [])
    assert bool(cfg.vae.path) == (name != "tiny")  # tiny stays in pixel space


# --------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def video5_data(tmp_path_factory):
    from data.synth_video import generate_video
    out = tmp_path_factory.mktemp("synth_video5")
    generate_video(str(out), count=8, heldout_count=2, size=32, frames=5, shard_size=8, seed=0)
    return str(out)


@pytest.mark.slow
def test_train_and_sample_in_wan_latent_space(wan_dir, video5_data, tmp_path):
    run = str(tmp_path / "run")
    args = [sys.executable, "-m", "pipelines.text2video.train", "--config", TINY_YAML, f"run.dir={run}",
            f"data.train_shards={video5_data}/train", f"data.eval_shards={video5_data}/heldout", *LATENT_MODEL,
            f"vae.path={wan_dir}", "train.steps=2", "train.log_every=1", "train.ckpt_every=2",
            "data.micro_batch_size=2"]
    proc = subprocess.run(args, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    metrics = read_metrics(run)
    assert sorted(metrics) == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in metrics.values())
    # The untrained DiT predicts 0 (zero final layer): step 1's loss is the mean square of the flow
    # targets of the first batch's latents, encoded here by the run's own VAE.
    from common.config import from_yaml_file
    from common.run import make_loader
    from pipelines.text2video.spec import SPEC
    cfg = from_yaml_file(SPEC.config, os.path.join(run, "config.yaml"))
    comp = SPEC.build(cfg)
    prepare, _ = SPEC.step_fns(comp, torch.device("cpu"))
    _, target = prepare(next(iter(make_loader(SPEC, comp, cfg, dp_rank=0, dp_size=1))))
    assert target.shape[-2:] == (4, 4)  # latents, not 32 x 32 pixels
    assert metrics[1]["loss"] == pytest.approx(target.pow(2).flatten(1).mean(1).mean().item(), rel=1e-5)
    from common.data.media import decode_video
    grid = decode_video(open(os.path.join(run, "samples", "step_00000002.mp4"), "rb").read(), dtype=torch.uint8)
    assert grid.shape == (5, 3, 2 + 34, 2 * 34 + 2)  # 2 decoded 5 x 32 x 32 clips tiled
    out = str(tmp_path / "out")
    proc = run_module("pipelines.text2video.sample", "--run", run, "--prompt", "a red circle moving up",
                      "--out", out, "--steps", "2", "--scale", "1")
    assert proc.returncode == 0, proc.stderr
    clip = decode_video(open(os.path.join(out, "00000.mp4"), "rb").read(), dtype=torch.uint8)
    assert clip.shape == (5, 3, 32, 32)  # decoded from 2 x 4 x 4 x 4 latents
