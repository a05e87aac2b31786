"""diffusers out for text2video: a run exported as a diffusers pipeline folder draws the clips
sample.py draws (pixel space with the run's fixed shift, other frame counts; latent space through Wan,
CogVideoX and frame-wise image VAEs with the token-count shift), loads with and without the folder's
code, holds the EMA or the trained weights as asked, and the export command's errors are one line
and leave nothing half-written. Also: the open_clip tower now lives in common/diffusion, and a
text2image folder exported before the move (naming pipelines.text2image.diffusers_pipeline as its
text_encoder's library) still loads."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tests.conftest import ROOT, run_checked, run_module, shared_once

TINY_YAML = os.path.join(ROOT, "pipelines/text2video/configs/tiny.yaml")
STEPS, CFG = 3, 3.0
PROMPTS = ["a red circle moving right", "a small blue square moving up"]
SEEDS = [7, 8]
# 8 frames of 32 px, patches 2 x 4 x 4 -> 256 tokens (as tests/test_t2v_train.py).
SMALL_MODEL = ["model.hidden=32", "model.depth=2", "model.heads=2", "text.width=32", "text.layers=1",
               "text.heads=2", "text.context_length=16", "sample.steps=2", "train.progress=false",
               "data.num_workers=0"]
# A few steps at a high constant LR so that every weight (the zero-initialised final layer too)
# moves off its init and the EMA copy differs from the trained weights.
FAST = ["train.steps=3", "optim.lr=1e-2", "optim.warmup_steps=1", "optim.schedule=constant",
        "data.micro_batch_size=8", "sample.num=0", "train.ckpt_every=3"]
# 5 pixel frames of 32 px -> Wan latents 2 x 4 x 4 (4 ch); patches 1 x 2 x 2 (as tests/test_t2v_latent.py).
LATENT_MODEL = ["model.frames=5", "model.patch_size=2", "model.temporal_patch=1", "model.hidden=32",
                "model.depth=2", "model.heads=2", "text.width=32", "text.layers=1", "text.heads=2",
                "text.context_length=16", "sample.steps=2"]


@pytest.fixture(autouse=True)
def _modules_cache(tmp_path, monkeypatch):
    """trust_remote_code copies the folder's pipeline.py into HF_MODULES_CACHE: keep it in tmp."""
    import diffusers.utils.dynamic_modules_utils as dm
    monkeypatch.setattr(dm, "HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def video_data(tmp_path_factory):
    from data.synth_video import generate_video
    return shared_once(tmp_path_factory, "synth-video", lambda out: generate_video(
        out, count=32, heldout_count=4, size=32, frames=8, shard_size=8, seed=0))


@pytest.fixture(scope="module")
def pixel_run(video_data, tmp_path_factory):
    """A tiny pixel-space run (tiny.yaml: fixed shift 3.0, EMA decay 0.995) of 3 steps and its export."""
    from tests.conftest import train_cmd
    d = tmp_path_factory.mktemp("t2v_export")
    run, out = str(d / "run"), str(d / "export")
    run_checked(train_cmd(module="pipelines.text2video.train") + [
        "--config", TINY_YAML, f"run.dir={run}", f"data.train_shards={video_data}/train",
        f"data.eval_shards={video_data}/heldout", *SMALL_MODEL, *FAST])
    proc = run_module("pipelines.text2video.export", "--run", run, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, out, proc.stdout


def ours(comp, frames: int | None = None):
    """(floats in [-1, 1] (B, 3, T, H, W), uint8 (B, T, H, W, 3)) of the run's own sampling code:
    what sample.py draws for PROMPTS with --seed 7 (components.generate), and the same before rounding."""
    from common.diffusion import text_conditioned as tc
    from pipelines.text2video import components
    c, t, h, w = comp.clip_shape
    if frames is not None:
        t = comp.vae.latent_frames(frames) if comp.vae is not None else frames
    floats = tc.generate(comp.model, comp.text_encoder, comp.objective, PROMPTS, SEEDS, shape=(c, t, h, w),
                         num_tokens=comp.model.cfg.tokens(t, h, w), steps=STEPS, guidance=CFG,
                         device=torch.device("cpu"), batch_size=8,
                         decode=comp.vae.decode if comp.vae is not None else None)[0]
    u8 = components.generate(comp, comp.model, PROMPTS, SEEDS, steps=STEPS, guidance=CFG, frames=frames)
    return floats.clamp(-1, 1), u8


def assert_same_clips(pipe, comp, frames: int | None = None, atol: float = 1e-4) -> float:
    """The pipeline's clips equal ours: floats within atol, uint8 within one level. Returns the
    max abs difference of the floats."""
    ref, ref_u8 = ours(comp, frames)
    pt = pipe(PROMPTS, num_inference_steps=STEPS, guidance_scale=CFG, num_frames=frames, seed=SEEDS[0],
              output_type="pt").frames  # (B, T, 3, H, W) in [0, 1]
    got = pt.permute(0, 2, 1, 3, 4) * 2 - 1
    assert got.shape == ref.shape, (got.shape, ref.shape)
    diff = (got - ref).abs().max().item()
    print(f"exported pipeline vs sample.py ({tuple(ref.shape)}): max abs diff {diff:.2e} on [-1, 1]")
    assert diff < atol, diff
    assert ref.std() > 0.05  # a real clip, not a constant the comparison could not fail on
    pil = pipe(PROMPTS, num_inference_steps=STEPS, guidance_scale=CFG, num_frames=frames,
               generator=[torch.Generator().manual_seed(s) for s in SEEDS], output_type="pil").frames
    u8 = torch.from_numpy(np.stack([np.stack([np.asarray(im) for im in clip]) for clip in pil]))
    assert u8.shape == ref_u8.shape
    assert (u8.int() - ref_u8.int()).abs().max().item() <= 1
    return diff


def dit_weights(pipe) -> dict:
    return {k.removeprefix("dit."): v for k, v in pipe.transformer.state_dict().items()}


def test_export_matches_sample(pixel_run):
    from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler

    from common.run import load_run
    from pipelines.text2video.diffusers_pipeline import TextToVideoPipeline
    from pipelines.text2video.spec import SPEC
    run, out, stdout = pixel_run
    assert "EMA weights (decay 0.995)" in stdout and "FlowMatchEulerDiscreteScheduler" in stdout
    assert "EMA weights (decay 0.995)" in open(os.path.join(out, "README.md")).read()
    assert sorted(os.listdir(out)) == ["README.md", "model_index.json", "pipeline.py", "scheduler", "text_encoder",
                                       "training_config.yaml", "transformer"]
    assert not os.path.exists(out + ".export-tmp")
    assert any(f.endswith(".safetensors") for f in os.listdir(os.path.join(out, "transformer")))
    index = json.load(open(os.path.join(out, "model_index.json")))
    assert index["_class_name"] == ["pipeline", "TextToVideoPipeline"] and index["vae"] == [None, None]
    assert index["transformer"] == ["pipelines.text2video.diffusers_pipeline", "TextToVideoDiTModel"]
    assert index["text_encoder"] == ["common.diffusion.diffusers_parts", "OpenCLIPTextModel"]
    assert index["resolution_shift"] is None and index["sample_frames"] == 8
    assert json.load(open(os.path.join(out, "scheduler", "scheduler_config.json")))["shift"] == 3.0

    comp, _ = load_run(SPEC, run)  # EMA weights, as sample.py loads them
    trained, _ = load_run(SPEC, run, use_ema=False)
    pipe = DiffusionPipeline.from_pretrained(out, trust_remote_code=True)
    assert isinstance(pipe, TextToVideoPipeline) and isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    exported = dit_weights(pipe)
    assert exported.keys() == comp.model.state_dict().keys()
    for k, v in comp.model.state_dict().items():
        assert torch.equal(exported[k], v), k
    assert any(not torch.equal(exported[k], v) for k, v in trained.model.state_dict().items())  # EMA != trained
    for k, v in comp.text_encoder.state_dict().items():
        assert torch.equal(pipe.text_encoder.encoder.state_dict()[k], v), k
    assert_same_clips(pipe, comp)
    assert_same_clips(pipe, comp, frames=5)  # sample.py --frames 5: odd, padded to the temporal patch
    # Loaded without running the folder's code: the same pipeline.
    plain = TextToVideoPipeline.from_pretrained(out)
    a = plain(PROMPTS[0], num_inference_steps=STEPS, guidance_scale=CFG, seed=3, output_type="latent").frames
    b = pipe(PROMPTS[0], num_inference_steps=STEPS, guidance_scale=CFG, seed=3, output_type="latent").frames
    assert torch.equal(a, b)
    # Without steps, guidance and frames: the run's sample.steps, sample.cfg and model.frames (2, 3.0, 8).
    assert (pipe.config.sample_steps, pipe.config.sample_guidance) == (2, 3.0)
    default = pipe(PROMPTS[0], seed=3, output_type="latent").frames
    assert default.shape == (1, 3, 8, 32, 32)
    assert torch.equal(default, pipe(PROMPTS[0], num_inference_steps=2, guidance_scale=3.0, num_frames=8, seed=3,
                                     output_type="latent").frames)
    np_frames = pipe(PROMPTS[0], seed=3).frames  # np by default: (B, T, H, W, 3) in [0, 1]
    assert np_frames.shape == (1, 8, 32, 32, 3) and 0 <= np_frames.min() and np_frames.max() <= 1


def test_export_trained_weights(pixel_run, tmp_path):
    from diffusers import DiffusionPipeline

    from common.run import load_run
    from pipelines.text2video.spec import SPEC
    run, ema_out, _ = pixel_run
    out = str(tmp_path / "trained")
    proc = run_module("pipelines.text2video.export", "--run", run, "--out", out, "--weights", "trained")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trained weights (--weights trained)" in proc.stdout
    assert "trained weights (--weights trained)" in open(os.path.join(out, "README.md")).read()
    trained, _ = load_run(SPEC, run, use_ema=False)
    got = dit_weights(DiffusionPipeline.from_pretrained(out, trust_remote_code=True))
    for k, v in trained.model.state_dict().items():
        assert torch.equal(got[k], v), k
    ema = dit_weights(DiffusionPipeline.from_pretrained(ema_out, trust_remote_code=True))
    assert sum(not torch.equal(ema[k], got[k]) for k in got) > len(got) // 2  # most tensors moved apart


def test_export_errors_are_one_line(pixel_run, tmp_path, monkeypatch, capsys):
    from common.checkpoint import CheckpointError
    from common.config import ConfigError
    from pipelines.text2video import export
    run, out, _ = pixel_run
    with pytest.raises(SystemExit) as e:
        export.main(["--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    assert "--weights {ema,trained}" in help_text and "trust_remote_code=True" in help_text
    proc = run_module("pipelines.text2video.export", "--run", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("error: run directory not found"), proc.stderr
    os.makedirs(tmp_path / "empty_run" / "checkpoints")
    (tmp_path / "empty_run" / "config.yaml").write_text(open(os.path.join(run, "config.yaml")).read())
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        export.main(["--run", str(tmp_path / "empty_run"), "--out", str(tmp_path / "o")])
    with pytest.raises(CheckpointError, match="not found"):
        export.main(["--run", run, "--checkpoint", str(tmp_path / "nockpt"), "--out", str(tmp_path / "o")])
    with pytest.raises(ConfigError, match="exists and is not empty"):
        export.main(["--run", run, "--out", out])
    assert not os.path.exists(tmp_path / "o")
    # A failure while writing leaves neither the folder nor its temporary sibling, and an existing
    # folder that --overwrite would replace stays as it was.
    os.makedirs(tmp_path / "kept")
    (tmp_path / "kept" / "marker").write_text("x")

    from pipelines.text2video.diffusers_pipeline import TextToVideoPipeline
    save = TextToVideoPipeline.save_pretrained

    def save_then_fail(self, folder, *args, **kwargs):  # the weights written, then the disk fills up
        save(self, folder, *args, **kwargs)
        assert os.path.isfile(os.path.join(folder, "model_index.json"))
        raise RuntimeError("disk full")
    monkeypatch.setattr(TextToVideoPipeline, "save_pretrained", save_then_fail)
    for target, flags in ((tmp_path / "o", []), (tmp_path / "kept", ["--overwrite"])):
        with pytest.raises(RuntimeError, match="disk full"):
            export.main(["--run", run, "--out", str(target), *flags])
        assert not os.path.exists(str(target) + ".export-tmp")
    assert not os.path.exists(tmp_path / "o") and os.listdir(tmp_path / "kept") == ["marker"]


# ---------------------------------------------------------------------- latent space
def make_wan(folder: str) -> None:
    from diffusers import AutoencoderKLWan
    torch.manual_seed(0)
    # Smallest Wan layout with the real factors (8x space, 4x time); per-channel statistics.
    AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, latents_mean=[0.1, -0.2, 0.3, 0.0],
                     latents_std=[1.5, 0.5, 2.0, 1.0]).save_pretrained(folder)


def make_image_vae(folder: str) -> None:
    from diffusers import AutoencoderKL
    torch.manual_seed(0)
    AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                  up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                  latent_channels=4, norm_num_groups=8, sample_size=32, scaling_factor=0.7,
                  shift_factor=0.05).save_pretrained(folder)


def perturbed(comp):
    """The components with the VideoDiT moved off its init (its final layer starts at zero: an
    untouched model would predict 0 and every clip would be the decoded noise)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in comp.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    comp.model.eval()
    return comp


def make_cogvideox(folder: str) -> None:
    from diffusers import AutoencoderKLCogVideoX
    torch.manual_seed(0)
    AutoencoderKLCogVideoX(block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1, norm_num_groups=4,
                           sample_height=32, sample_width=32, scaling_factor=0.9).save_pretrained(folder)


VAES = {"wan": (make_wan, "AutoencoderKLWan", []),
        "cogvideox": (make_cogvideox, "AutoencoderKLCogVideoX", ["model.frames=9"]),  # odd latent count: 3
        "image": (make_image_vae, "AutoencoderKL", ["vae.scaling_factor=0.5"])}


@pytest.mark.parametrize("kind", sorted(VAES))
def test_latent_pipeline_round_trip(kind, tmp_path):
    """A latent run's pipeline (no training: build_pipeline on built components) saved and
    reloaded draws what sample.py draws: Wan (causal, per-channel mean / std, other frame counts),
    CogVideoX (causal, odd latent counts) and an image VAE frame by frame (shift and a
    vae.scaling_factor override); the shift follows the token count (diffusion.shift=0) as the
    run's does."""
    from diffusers import DiffusionPipeline

    from common.config import build_config
    from pipelines.text2video import components
    from pipelines.text2video.config import T2VConfig
    from pipelines.text2video.export import build_pipeline
    make, class_name, extra = VAES[kind]
    vae_dir = str(tmp_path / "vae")
    make(vae_dir)
    cfg = build_config(T2VConfig, TINY_YAML, LATENT_MODEL + [f"vae.path={vae_dir}", "diffusion.shift=0", *extra])
    comp = perturbed(components.build(cfg))
    out = str(tmp_path / "export")
    build_pipeline(comp).save_pretrained(out)
    index = json.load(open(os.path.join(out, "model_index.json")))
    assert index["vae"] == ["diffusers", class_name]
    assert index["latent_scale"] == pytest.approx(comp.vae.scale.flatten().tolist())
    assert index["resolution_shift"] == [1.0, 256]
    pipe = DiffusionPipeline.from_pretrained(out, trust_remote_code=True)
    assert_same_clips(pipe, comp)
    if kind == "wan":
        # 9 pixel frames -> 3 latent frames: 12 tokens, not the run's 8, so another shift (1 + k*4 rule).
        assert_same_clips(pipe, comp, frames=9)
        with pytest.raises(ValueError, match="1 \\+ k\\*4"):
            pipe(PROMPTS[0], num_frames=8, seed=0)
    elif kind == "cogvideox":
        with pytest.raises(ValueError, match="odd number of latent frames"):
            pipe(PROMPTS[0], num_frames=5, seed=0)  # 2 latent frames would decode to 8 frames
    else:
        assert_same_clips(pipe, comp, frames=3)  # frame by frame: any count


def test_export_wan_latent_run(tmp_path):
    """The export command on a trained latent run (Wan VAE): vae/ is the native AutoencoderKLWan
    with the run's weights, and the folder draws what sample.py draws."""
    from diffusers import AutoencoderKLWan, DiffusionPipeline

    from common.run import load_run
    from data.synth_video import generate_video
    from pipelines.text2video.spec import SPEC
    from tests.conftest import train_cmd
    data, vae_dir = str(tmp_path / "data"), str(tmp_path / "vae")
    generate_video(data, count=8, heldout_count=2, size=32, frames=5, shard_size=8, seed=0)
    make_wan(vae_dir)
    run, out = str(tmp_path / "run"), str(tmp_path / "export")
    run_checked(train_cmd(module="pipelines.text2video.train") + [
        "--config", TINY_YAML, f"run.dir={run}", f"data.train_shards={data}/train", f"data.eval_shards={data}/heldout",
        *LATENT_MODEL, f"vae.path={vae_dir}", "train.progress=false", "data.num_workers=0", *FAST,
        "data.micro_batch_size=2"])
    proc = run_module("pipelines.text2video.export", "--run", run, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "vae (AutoencoderKLWan)" in proc.stdout
    comp, _ = load_run(SPEC, run)
    pipe = DiffusionPipeline.from_pretrained(out, trust_remote_code=True)
    assert isinstance(pipe.vae, AutoencoderKLWan)
    for k, v in comp.vae.vae.state_dict().items():
        assert torch.equal(pipe.vae.state_dict()[k], v), k
    assert_same_clips(pipe, comp)


# ---------------------------------------------------------------------- shared parts
def test_text2image_folder_from_before_the_move_loads(tmp_path):
    """OpenCLIPTextModel moved to common.diffusion.diffusers_parts (new folders name it there); a
    text2image folder naming pipelines.text2image.diffusers_pipeline as its text_encoder's library
    loads, with and without the folder's code, and samples as the new one."""
    from diffusers import DiffusionPipeline

    from common.diffusion import RectifiedFlow
    from common.diffusion.diffusers_parts import OpenCLIPTextModel as Shared
    from common.nn.text_encoder import TextEncoder, TextEncoderConfig
    from pipelines.text2image.diffusers_pipeline import (OpenCLIPTextModel, TextToImageDiTModel, TextToImagePipeline,
                                                         scheduler_for)
    from pipelines.text2image.model import DiT, dit_config
    assert OpenCLIPTextModel is Shared
    torch.manual_seed(0)
    dit = DiT(dit_config("tiny", img_size=16, hidden=32, depth=1, heads=2, text_dim=32)).eval()
    with torch.no_grad():  # off the zero final layer, so the sample depends on the text tower
        for p in dit.parameters():
            p.add_(0.05 * torch.randn_like(p))
    text = TextEncoder(TextEncoderConfig(width=32, layers=1, heads=2, context_length=16, layer_scale=1e-3))
    pipe = TextToImagePipeline(transformer=TextToImageDiTModel.from_dit(dit), text_encoder=Shared.from_encoder(text),
                               scheduler=scheduler_for(RectifiedFlow(shift=2.0), 16))
    out = str(tmp_path / "t2i")
    pipe.save_pretrained(out)
    path = os.path.join(out, "model_index.json")
    index = json.load(open(path))
    assert index["text_encoder"] == ["common.diffusion.diffusers_parts", "OpenCLIPTextModel"]
    new = TextToImagePipeline.from_pretrained(out)(PROMPTS[0], num_inference_steps=2, seed=0, output_type="latent").images
    index["text_encoder"] = ["pipelines.text2image.diffusers_pipeline", "OpenCLIPTextModel"]  # as written before
    json.dump(index, open(path, "w"))
    for old in (DiffusionPipeline.from_pretrained(out, trust_remote_code=True), TextToImagePipeline.from_pretrained(out)):
        assert isinstance(old.text_encoder, Shared)
        assert torch.equal(old(PROMPTS[0], num_inference_steps=2, seed=0, output_type="latent").images, new)
