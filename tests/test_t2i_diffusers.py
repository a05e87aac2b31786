"""diffusers in and out for text2image: a run exported as a diffusers pipeline draws the image
sample.py draws (flow and DDPM, pixels and VAE latents, open_clip / CLIP / T5 text towers, DiT and
UNet denoisers); Hugging Face CLIP and T5 text encoders from local folders; model.init_from from an
exported folder or a checkpoint; one-line errors of the export command."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tests.conftest import run_module, run_train

STEPS, CFG = 4, 3.0
PROMPTS = ["a red circle", "a small blue square at the top left"]
SEEDS = [7, 8]
# A few steps at a high constant LR so that every weight (the zero-initialised final layer too)
# moves off its init and the EMA copy differs from the trained weights.
FAST = ["train.steps=3", "optim.lr=1e-2", "optim.warmup_steps=1", "optim.schedule=constant",
        "data.micro_batch_size=8", "sample.num=0", "train.ckpt_every=3"]


@pytest.fixture(autouse=True)
def _modules_cache(tmp_path, monkeypatch):
    """trust_remote_code copies the folder's pipeline.py into HF_MODULES_CACHE: keep it in tmp."""
    import diffusers.utils.dynamic_modules_utils as dm
    monkeypatch.setattr(dm, "HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def ours(comp):
    """(floats in [-1, 1] (B, C, H, W), uint8 (B, H, W, 3)) of the run's own sampling code: what
    sample.py draws for PROMPTS with --seed 7 (components.generate), and the same before rounding."""
    from common.diffusion import text_conditioned as tc
    from pipelines.text2image import components
    decode = (lambda x: comp.vae.decode(comp.from_model_space(x)).sample) if comp.vae is not None else None
    floats = tc.generate(comp.model, comp.text_encoder, comp.objective, PROMPTS, SEEDS,
                         shape=(comp.latent_channels, comp.latent_size, comp.latent_size), num_tokens=comp.num_tokens,
                         steps=STEPS, guidance=CFG, device=torch.device("cpu"), batch_size=32, decode=decode)[0]
    return floats.clamp(-1, 1), components.generate(comp, comp.model, PROMPTS, SEEDS, steps=STEPS, guidance=CFG)


def assert_same_images(pipe, comp, atol=1e-4) -> float:
    """The pipeline's images equal ours: floats within atol, uint8 within one level. Returns the
    max abs difference of the floats."""
    ref, ref_u8 = ours(comp)
    pt = pipe(PROMPTS, num_inference_steps=STEPS, guidance_scale=CFG, seed=SEEDS[0], output_type="pt").images
    diff = (pt * 2 - 1 - ref).abs().max().item()
    print(f"exported pipeline vs sample.py: max abs diff {diff:.2e} on [-1, 1]")
    assert diff < atol, diff
    assert ref.std() > 0.05  # a real image, not a constant the comparison could not fail on
    pil = pipe(PROMPTS, num_inference_steps=STEPS, guidance_scale=CFG,
               generator=[torch.Generator().manual_seed(s) for s in SEEDS]).images
    u8 = torch.from_numpy(np.stack([np.asarray(im) for im in pil]))
    assert (u8.int() - ref_u8.int()).abs().max().item() <= 1
    return diff


@pytest.fixture(scope="module")
def flow_run(synth_data, tmp_path_factory):
    """A tiny flow run (open_clip tower, pixels) and its export."""
    d = tmp_path_factory.mktemp("flow")
    run, out = str(d / "run"), str(d / "export")
    run_train(run, synth_data, *FAST)
    proc = run_module("pipelines.text2image.export", "--run", run, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, out, proc.stdout


def test_export_flow_matches_sample(flow_run):
    from diffusers import DiffusionPipeline

    from common.run import load_run
    from pipelines.text2image.diffusers_pipeline import TextToImagePipeline
    from pipelines.text2image.spec import SPEC
    run, out, stdout = flow_run
    assert "EMA weights (decay 0.995)" in stdout and "FlowMatchEulerDiscreteScheduler" in stdout
    assert "EMA weights (decay 0.995)" in open(os.path.join(out, "README.md")).read()
    index = json.load(open(os.path.join(out, "model_index.json")))
    assert index["_class_name"] == ["pipeline", "TextToImagePipeline"] and index["vae"] == [None, None]
    assert json.load(open(os.path.join(out, "scheduler", "scheduler_config.json")))["shift"] == 3.0

    comp, _ = load_run(SPEC, run)  # EMA weights, as sample.py loads them
    trained, _ = load_run(SPEC, run, use_ema=False)
    pipe = DiffusionPipeline.from_pretrained(out, trust_remote_code=True)
    assert isinstance(pipe, TextToImagePipeline)
    exported = {k.removeprefix("dit."): v for k, v in pipe.transformer.state_dict().items()}
    for k, v in comp.model.state_dict().items():
        assert torch.equal(exported[k], v), k
    assert any(not torch.equal(exported[k], v) for k, v in trained.model.state_dict().items())  # EMA != trained
    assert_same_images(pipe, comp)
    # Loaded without running the folder's code: the same pipeline.
    plain = TextToImagePipeline.from_pretrained(out)
    a = plain(PROMPTS[0], num_inference_steps=STEPS, guidance_scale=CFG, seed=3, output_type="latent").images
    b = pipe(PROMPTS[0], num_inference_steps=STEPS, guidance_scale=CFG, seed=3, output_type="latent").images
    assert torch.equal(a, b)
    # Without steps and guidance: the run's sample.steps and sample.cfg (tiny.yaml: 2 and 3.0), as sample.py.
    assert (pipe.config.sample_steps, pipe.config.sample_guidance) == (2, 3.0)
    default = pipe(PROMPTS[0], seed=3, output_type="latent").images
    assert torch.equal(default, pipe(PROMPTS[0], num_inference_steps=2, guidance_scale=3.0, seed=3,
                                     output_type="latent").images)


def test_export_errors_are_one_line(flow_run, tmp_path):
    from common.checkpoint import CheckpointError
    from common.config import ConfigError
    from pipelines.text2image.export import main
    run, out, _ = flow_run
    proc = run_module("pipelines.text2image.export", "--run", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("error: run directory not found"), proc.stderr
    os.makedirs(tmp_path / "empty_run" / "checkpoints")
    (tmp_path / "empty_run" / "config.yaml").write_text(open(os.path.join(run, "config.yaml")).read())
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        main(["--run", str(tmp_path / "empty_run"), "--out", str(tmp_path / "o")])
    with pytest.raises(ConfigError, match="exists and is not empty"):
        main(["--run", run, "--out", out])
    assert not os.path.exists(tmp_path / "o")


def test_init_from_export_and_checkpoint(flow_run, tmp_path):
    from common.config import ConfigError, build_config
    from common.run import load_run
    from pipelines.text2image import components
    from pipelines.text2image.config import T2IConfig
    from pipelines.text2image.diffusers_pipeline import init_from
    from pipelines.text2image.spec import SPEC
    run, out, _ = flow_run
    ref, _ = load_run(SPEC, run)  # EMA weights and the run's frozen tower
    cfg = build_config(T2IConfig, os.path.join(run, "config.yaml"), ["run.seed=5"])  # another init and tower
    for source in (out, run):
        comp = components.build(cfg)
        before = [torch.equal(v, w) for v, w in zip(ref.model.state_dict().values(), comp.model.state_dict().values())]
        assert not all(before)
        what = init_from(comp, source)
        for (k, v), w in zip(ref.model.state_dict().items(), comp.model.state_dict().values()):
            assert torch.equal(v, w), (source, k)
        for (k, v), w in zip(ref.text_encoder.state_dict().items(), comp.text_encoder.state_dict().values()):
            assert torch.equal(v, w), (source, k)
        assert comp.model.training and ("EMA" in what or "pipeline folder" in what), what
    bad = build_config(T2IConfig, os.path.join(run, "config.yaml"), ["model.depth=3"])
    for source in (out, run):
        with pytest.raises(ConfigError, match="depth"):
            init_from(components.build(bad), source)


# ---------------------------------------------------------------------- Hugging Face text encoders
def make_clip(folder: str, width: int = 32, positions: int = 16, projection_dim: int | None = None) -> None:
    """A tiny random CLIPTextModel (with projection_dim: a CLIPTextModelWithProjection, and a
    tokenizer whose model_max_length is `positions`) and a CLIP BPE tokenizer over single characters
    (every lower-case word splits into letters) plus two merges."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in "abcdefghijklmnopqrstuvwxyz":
        vocab[c], vocab[c + "</w>"] = len(vocab), len(vocab) + 1
    vocab["re"], vocab["red</w>"] = len(vocab), len(vocab) + 1
    os.makedirs(folder, exist_ok=True)
    json.dump(vocab, open(os.path.join(folder, "vocab.json"), "w"))
    open(os.path.join(folder, "merges.txt"), "w").write("#version: 0.2\nr e\nre d</w>\n")
    extra = {} if projection_dim is None else {"model_max_length": positions}
    tok = CLIPTokenizer(os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt"),
                        pad_token="<|endoftext|>", **extra)
    torch.manual_seed(0)
    config = CLIPTextConfig(vocab_size=len(vocab), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=1,
                            num_attention_heads=2, max_position_embeddings=positions, bos_token_id=0, eos_token_id=1,
                            pad_token_id=1, projection_dim=projection_dim or width)
    model = CLIPTextModel(config) if projection_dim is None else CLIPTextModelWithProjection(config)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def make_t5(folder: str, width: int = 32) -> None:
    """A tiny random T5EncoderModel and a unigram tokenizer over a handful of words and letters."""
    from transformers import T5Config, T5EncoderModel, T5Tokenizer
    words = ["▁a", "▁red", "▁blue", "▁circle", "▁square", "▁small", "▁"] + list("abcdefghijklmnopqrstuvwxyz")
    tok = T5Tokenizer(vocab=[("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(w, -1.0 - i) for i, w in enumerate(words)],
                      extra_ids=0)
    torch.manual_seed(0)
    model = T5EncoderModel(T5Config(vocab_size=len(words) + 3, d_model=width, d_kv=16, d_ff=2 * width, num_layers=1,
                                    num_heads=2, decoder_start_token_id=0))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def assert_features_are_the_models(enc, folder: str, cls_name: str) -> None:
    """Each caption's real-token features equal the HF model run on that caption alone (no
    padding), and the mask marks exactly those tokens."""
    import transformers
    model = getattr(transformers, cls_name).from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    captions = PROMPTS + [""]
    feats, mask = enc(captions)
    assert feats.shape == (3, enc.context_length, enc.width) and mask.dtype == torch.bool
    for i, c in enumerate(captions):
        ids = tok(c, max_length=enc.context_length, truncation=True, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            alone = model(input_ids=ids).last_hidden_state[0]
        assert int(mask[i].sum()) == alone.shape[0]
        torch.testing.assert_close(feats[i, :alone.shape[0]], alone, atol=1e-5, rtol=1e-5)


def test_hf_clip_text_encoder_ddpm_vae_export(synth_data, tmp_path):
    """text.hf_path with a CLIP folder: features equal the model's, 2 training steps with a local
    VAE and DDPM (v-prediction), and the export (native CLIPTextModel, tokenizer, AutoencoderKL,
    DPM-Solver order 1) draws what sample.py draws."""
    from diffusers import AutoencoderKL, DiffusionPipeline, DPMSolverMultistepScheduler

    from common.config import TextConfig
    from common.nn.text_encoder import HFTextEncoder, build_text_encoder
    from common.run import load_run
    from pipelines.text2image.spec import SPEC
    clip = str(tmp_path / "clip")
    make_clip(clip)
    enc = build_text_encoder(TextConfig(width=32, context_length=16, hf_path=clip), run_seed=0)
    assert isinstance(enc, HFTextEncoder) and not any(p.requires_grad for p in enc.parameters())
    assert_features_are_the_models(enc, clip, "CLIPTextModel")

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                        latent_channels=4, norm_num_groups=8, sample_size=32)
    vae.save_pretrained(str(tmp_path / "vae"))
    run, out = str(tmp_path / "run"), str(tmp_path / "export")
    run_train(run, synth_data, *FAST, f"text.hf_path={clip}", f"vae.path={tmp_path / 'vae'}", "vae.scaling_factor=0.7",
              "model.patch_size=2", "diffusion.objective=ddpm", "diffusion.ddpm_prediction=v")
    proc = run_module("pipelines.text2image.export", "--run", run, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    index = json.load(open(os.path.join(out, "model_index.json")))
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"] and index["vae"] == ["diffusers", "AutoencoderKL"]
    comp, _ = load_run(SPEC, run)
    assert_features_are_the_models(comp.text_encoder, clip, "CLIPTextModel")  # frozen through the checkpoint
    pipe = DiffusionPipeline.from_pretrained(out, trust_remote_code=True)
    assert isinstance(pipe.scheduler, DPMSolverMultistepScheduler) and pipe.vae.config.scaling_factor == 0.7
    assert_same_images(pipe, comp)


def test_hf_t5_text_encoder_trains_and_exports(synth_data, tmp_path):
    from diffusers import DiffusionPipeline

    from common.config import ConfigError, TextConfig
    from common.nn.text_encoder import build_text_encoder
    from common.run import load_run
    from pipelines.text2image.spec import SPEC
    t5 = str(tmp_path / "t5")
    make_t5(t5)
    enc = build_text_encoder(TextConfig(width=32, context_length=16, hf_path=t5), run_seed=0)
    assert_features_are_the_models(enc, t5, "T5EncoderModel")
    with pytest.raises(ConfigError, match="set text.width=32"):
        build_text_encoder(TextConfig(width=48, context_length=16, hf_path=t5), run_seed=0)
    run, out = str(tmp_path / "run"), str(tmp_path / "export")
    # eps-prediction on the linear schedule. (On the cosine schedule the first DDIM step divides by
    # sqrt(alpha_bar_999) ~ 5e-5: an untrained eps model's x0 reaches ~1e4, and float32 rounding of
    # the two algebraically equal updates differs by ~1e-7 of that, ~6e-4 after clamping.)
    overrides = (*FAST, f"text.hf_path={t5}", "diffusion.objective=ddpm", "diffusion.ddpm_schedule=linear")
    run_train(run, synth_data, *overrides)
    proc = run_module("pipelines.text2image.export", "--run", run, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    comp, meta = load_run(SPEC, run)
    pipe = DiffusionPipeline.from_pretrained(out, trust_remote_code=True)
    assert type(pipe.text_encoder).__name__ == "T5EncoderModel" and pipe.tokenizer is not None
    assert_same_images(pipe, comp)
    assert_tower_fingerprinted_not_saved(run, meta["path"], t5, comp.text_encoder,
                                         resume=lambda: run_train(run, synth_data, *overrides, "train.steps=6",
                                                                  "run.resume=auto", check=False))


def test_bf16_frozen_text_towers(synth_data, tmp_path):
    """text.dtype=bf16 holds a frozen tower's weights in bf16 (half the bytes) and hands on fp32
    features within bf16 rounding of the fp32 tower's (Hugging Face T5, open_clip); the checkpoint
    signature names it only when not fp32 (older checkpoints still load); a run trains on it and
    sample/eval reload it (its fingerprint is the bf16 weights')."""
    from diffusers import DiffusionPipeline

    from common.config import ConfigError, TextConfig
    from common.nn.text_encoder import build_text_encoder, text_signature
    from common.run import load_run
    from pipelines.text2image.spec import SPEC
    t5 = str(tmp_path / "t5")
    make_t5(t5)
    for kind in ({"hf_path": t5}, {"layers": 1, "heads": 2, "layer_scale": 1e-3}):
        ref = build_text_encoder(TextConfig(width=32, context_length=16, **kind), run_seed=0)
        half = build_text_encoder(TextConfig(width=32, context_length=16, dtype="bf16", **kind), run_seed=0)
        assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
        assert 2 * sum(p.nbytes for p in half.parameters()) == sum(p.nbytes for p in ref.parameters())
        (a, mask), (b, half_mask) = ref(PROMPTS), half(PROMPTS)
        assert b.dtype == torch.float32 and torch.equal(mask, half_mask)
        rel = ((a - b).norm() / a.norm()).item()
        assert 0 < rel < 2e-2, (kind, rel)  # bf16 keeps 8 bits of mantissa: ~0.4% per rounding
    assert "dtype" not in text_signature(TextConfig()) and text_signature(TextConfig(dtype="bf16"))["dtype"] == "bf16"
    with pytest.raises(ConfigError, match="text.dtype='fp16'"):
        build_text_encoder(TextConfig(dtype="fp16"), run_seed=0)
    run, out = str(tmp_path / "run"), str(tmp_path / "export")
    run_train(run, synth_data, *FAST, f"text.hf_path={t5}", "text.dtype=bf16")
    comp, _ = load_run(SPEC, run)
    assert next(comp.text_encoder.parameters()).dtype == torch.bfloat16
    # Exported in fp32 (the bf16 values), so that the pipeline holds one dtype and samples.
    proc = run_module("pipelines.text2image.export", "--run", run, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pipe = DiffusionPipeline.from_pretrained(out, trust_remote_code=True)
    assert pipe.text_encoder.dtype == torch.float32
    weight = next(pipe.text_encoder.parameters())
    assert torch.equal(weight, weight.bfloat16().float())
    images = pipe(PROMPTS, num_inference_steps=2, guidance_scale=CFG, seed=SEEDS[0], output_type="pt").images
    assert images.shape == (2, 3, 32, 32) and images.isfinite().all()


def assert_tower_fingerprinted_not_saved(run: str, ckpt: str, folder: str, tower, resume) -> None:
    """The checkpoint holds no tensor of the folder's text tower, only its fingerprint; once the
    folder's weights change, sample/eval/export (load_run) and resume refuse in one line."""
    import torch.distributed.checkpoint as dcp
    import transformers

    from common.checkpoint import CheckpointError, read_meta
    from common.frozen_weights import weights_fingerprint
    from common.run import load_run
    from pipelines.text2image.spec import SPEC
    keys = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    assert any(k.startswith("model.") for k in keys) and not any(k.startswith("text_encoder") for k in keys)
    assert read_meta(ckpt)["frozen_folders"]["text_encoder"] == {"folder": folder,
                                                                 "fingerprint": weights_fingerprint(tower)}
    model = transformers.AutoModel.from_pretrained(folder)
    with torch.no_grad():
        next(model.parameters())[0, 0] += 1e-3
    model.save_pretrained(folder)
    with pytest.raises(CheckpointError, match="now holds other weights"):
        load_run(SPEC, run)
    proc = resume()
    assert proc.returncode != 0 and "now holds other weights" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


# ---------------------------------------------------------------------- UNet denoiser
def test_pipeline_with_native_unet_matches_our_sampler():
    """The pipeline's unet branch (a native UNet2DConditionModel; pooled text as class labels,
    space-to-depth around it) samples what our sampler samples with pipelines/text2image/unet.py."""
    unet_mod = pytest.importorskip("pipelines.text2image.unet")
    from diffusers import FlowMatchEulerDiscreteScheduler

    from common.diffusion import RectifiedFlow
    from common.diffusion import text_conditioned as tc
    from common.nn.text_encoder import TextEncoder, TextEncoderConfig
    from pipelines.text2image.diffusers_pipeline import OpenCLIPTextModel, TextToImagePipeline, scheduler_for
    torch.manual_seed(0)
    model = unet_mod.UNet(unet_mod.unet_config("tiny", img_size=16, text_dim=32)).eval()
    for p in model.parameters():  # off the zero init, so the output depends on every layer
        p.data.add_(0.05 * torch.randn_like(p))
    text = TextEncoder(TextEncoderConfig(width=32, layers=1, heads=2, context_length=16, layer_scale=1e-3))
    objective = RectifiedFlow(shift=2.0)
    ref = tc.generate(model, text, objective, PROMPTS, SEEDS, shape=(3, 16, 16), num_tokens=64, steps=STEPS,
                      guidance=CFG, device=torch.device("cpu"), batch_size=32)[0]
    pipe = TextToImagePipeline(text_encoder=OpenCLIPTextModel.from_encoder(text), unet=model.unet,
                               scheduler=scheduler_for(objective, 64), unet_pooled_text=model.cfg.pooled_text,
                               unet_patch_size=model.cfg.patch_size)
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    got = pipe(PROMPTS, num_inference_steps=STEPS, guidance_scale=CFG, seed=SEEDS[0], output_type="latent").images
    assert ref.std() > 0.05
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_export_unet_run(synth_data, tmp_path):
    """model.arch=unet: the export holds the native UNet2DConditionModel (unet/) and draws what
    sample.py draws."""
    from diffusers import DiffusionPipeline, UNet2DConditionModel

    from common.run import load_run
    from pipelines.text2image.spec import SPEC
    from tests.conftest import ROOT, run_checked, train_cmd
    run, out = str(tmp_path / "run"), str(tmp_path / "export")
    run_checked(train_cmd() + ["--config", os.path.join(ROOT, "pipelines/text2image/configs/tiny_unet.yaml"),
                               f"run.dir={run}", f"data.train_shards={synth_data}/train",
                               f"data.eval_shards={synth_data}/heldout", "text.width=32", "text.layers=1",
                               "text.heads=2", "text.context_length=16", "train.progress=false",
                               "data.num_workers=0", "model.image_size=16", *FAST])
    proc = run_module("pipelines.text2image.export", "--run", run, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    comp, _ = load_run(SPEC, run)
    pipe = DiffusionPipeline.from_pretrained(out, trust_remote_code=True)
    assert isinstance(pipe.unet, UNet2DConditionModel) and pipe.transformer is None
    for k, v in comp.model.unet.state_dict().items():
        assert torch.equal(pipe.unet.state_dict()[k], v), k
    assert_same_images(pipe, comp)
    # model.init_from with the exported folder: the UNet's weights, into a differently seeded build.
    from common.config import build_config
    from pipelines.text2image import components
    from pipelines.text2image.config import T2IConfig
    from pipelines.text2image.diffusers_pipeline import init_from
    fresh = components.build(build_config(T2IConfig, os.path.join(run, "config.yaml"), ["run.seed=5"]))
    assert "unet" in init_from(fresh, out)
    for (k, v), w in zip(comp.model.state_dict().items(), fresh.model.state_dict().values()):
        assert torch.equal(v, w), k
