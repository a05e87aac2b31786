"""text2image with model.arch=sd3 (pipelines/text2image/sd3.py): diffusers' SD3 transformer (MMDiT)
behind the DiT's interface. Its forward equals diffusers' own call with the run's caption features
as the joint stream and their mean over real tokens as the pooled vector, or, with SD3's own text
stack (text.hf_path = an SD3 pipeline folder: CLIP-L, CLIP-G, T5), with exactly the conditioning
diffusers' StableDiffusion3Pipeline.encode_prompt computes; the presets are SD3's settings;
model.preset=folder builds an SD3-layout folder's exact transformer (SD3.5's dual attention and
QK norm included) and model.init_from loads its weights; folders the run's tower cannot feed are
refused with the widths named; fine-tuned runs sample through sample.py as the library draws;
data parallelism equals one process."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np

import pytest
import torch
from PIL import Image

from tests.conftest import ROOT, assert_same_losses_to_rounding, run_checked, run_module, shared_once, train_cmd
from tests.test_t2i_diffusers import CFG, FAST, PROMPTS, SEEDS, STEPS, ours
from tests.test_t2i_pixart import LAYOUTS, assert_layout_trains_as_one_process, run_transformer

TINY_YAML = os.path.join(ROOT, "pipelines/text2image/configs/tiny.yaml")
WIDTH = 128  # tiny.yaml's text.width: the folder's caption and pooled widths
# A small SD3.5-style transformer on 32 px pixels: QK RMS-norm, dual attention in its first block, a
# position table larger than the 8 x 8 patch grid (cropped), sample_size unlike the run's.
SD3_KWARGS = dict(sample_size=16, patch_size=4, in_channels=3, out_channels=3, num_layers=2, attention_head_dim=8,
                  num_attention_heads=2, joint_attention_dim=WIDTH, caption_projection_dim=16,
                  pooled_projection_dim=WIDTH, pos_embed_max_size=12, dual_attention_layers=[0], qk_norm="rms_norm")
# stabilityai/stable-diffusion-3-medium-diffusers' transformer/config.json (bookkeeping keys aside).
SD3_MEDIUM = dict(attention_head_dim=64, caption_projection_dim=1536, in_channels=16, joint_attention_dim=4096,
                  num_attention_heads=24, num_layers=24, out_channels=16, patch_size=2, pooled_projection_dim=2048,
                  pos_embed_max_size=192, sample_size=128)


def make_sd3_folder(folder: str) -> None:
    """A diffusers pipeline folder laid out as SD3's: model_index.json and transformer/ (random
    weights, proj_out too, so that a load that silently kept the run's init would show)."""
    from diffusers import SD3Transformer2DModel
    torch.manual_seed(5)
    SD3Transformer2DModel(**SD3_KWARGS).save_pretrained(os.path.join(folder, "transformer"))
    json.dump({"_class_name": "StableDiffusion3Pipeline", "transformer": ["diffusers", "SD3Transformer2DModel"]},
              open(os.path.join(folder, "model_index.json"), "w"))


@pytest.fixture(scope="module")
def sd3_folder(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("sd3") / "sd3")
    make_sd3_folder(folder)
    return folder


def folder_overrides(folder: str) -> list[str]:
    return ["model.arch=sd3", "model.preset=folder", f"model.init_from={folder}"]


def t2i_cfg(*overrides: str):
    from common.config import build_config
    from pipelines.text2image.config import T2IConfig
    return build_config(T2IConfig, TINY_YAML, list(overrides))


def tiny_sd3(**overrides):
    from pipelines.text2image.sd3 import SD3, sd3_config
    torch.manual_seed(0)
    model = SD3(sd3_config("tiny", text_dim=32, text_len=8, **overrides))
    with torch.no_grad():  # the zero-initialised output would make every comparison trivially equal
        for p in model.parameters():
            if not p.any():
                p.normal_(0, 0.05)
    return model.eval()


def inputs(batch: int = 2, seed: int = 1, width: int = 32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, 32, 32, generator=g)
    t = torch.rand(batch, generator=g)
    ctx = torch.randn(batch, 8, width, generator=g)
    mask = torch.ones(batch, 8, dtype=torch.bool)
    mask[0, 5:] = False
    mask[1, 3:] = False
    return x, t, ctx, mask


def diffusers_call(transformer, x, t, ctx, pooled):
    return transformer(hidden_states=x, encoder_hidden_states=ctx, pooled_projections=pooled, timestep=t * 1000,
                       return_dict=False)[0]


# --------------------------------------------------------------------------- the model
def test_tiny_sd3_is_diffusers_called_with_pooled_caption():
    """The wrapper's forward is SD3Transformer2DModel's at t * 1000, with the caption tokens as the
    joint stream (padding included, as SD3 attends to it) and their mean over the real tokens as the
    pooled vector; the untrained model predicts 0, as the DiT."""
    from pipelines.text2image.sd3 import SD3, sd3_config
    untrained = SD3(sd3_config("tiny", text_dim=32))
    assert torch.all(untrained(*inputs()) == 0)
    model = tiny_sd3()
    x, t, ctx, mask = inputs()
    pooled = torch.stack([ctx[0, :5].double().mean(0), ctx[1, :3].double().mean(0)]).float()
    with torch.no_grad():
        got = model(x, t, ctx, mask)
        direct = diffusers_call(model.transformer, x, t, ctx, pooled)
        noisy = ctx.clone()
        noisy[~mask] = 10 * torch.randn(int((~mask).sum()), 32)
        changed = model(x, t, noisy, mask)
        unmasked = model(x, t, ctx, None)
    torch.testing.assert_close(got, direct, rtol=1e-6, atol=1e-6)
    assert (changed - got).abs().max() > 1e-4  # padded tokens are attended to, as SD3 does
    assert (unmasked - got).abs().max() > 1e-4  # and without a mask the pooled vector is the plain mean
    assert got.std() > 1e-3 and got.shape == x.shape


def test_sd3_presets_and_flops():
    """`medium` is SD3 Medium's transformer setting for setting but the pooled width (here the
    run's text width, there CLIP-L + CLIP-G's 2048), about 2B parameters; the size fields size it."""
    from pipelines.text2image.sd3 import SD3, diffusers_kwargs, sd3_config
    kw = diffusers_kwargs(sd3_config("medium"))
    assert {k: v for k, v in kw.items() if k in SD3_MEDIUM} == dict(SD3_MEDIUM, pooled_projection_dim=4096)
    with torch.device("meta"):
        medium = SD3(sd3_config("medium"))
    assert len(medium.blocks) == 24 and 2.0e9 < sum(p.numel() for p in medium.parameters()) < 2.1e9
    small, wide = tiny_sd3(), tiny_sd3(hidden=256, heads=8)
    assert wide.flops_per_sample() > 3 * small.flops_per_sample() > 0


def test_sd3_folder_config_maps_to_the_same_transformer():
    """An SD3.5-style config (dual attention, QK norm, a cropped position table) round-trips through
    SD3Config to the same constructor arguments."""
    from pipelines.text2image.sd3 import diffusers_kwargs, sd3_config_from_diffusers
    config = dict(SD3_KWARGS, _class_name="SD3Transformer2DModel", _diffusers_version="0.42.1")
    cfg = sd3_config_from_diffusers(config, img_size=32, in_channels=3, text_dim=WIDTH, text_len=32)
    assert (cfg.hidden, cfg.depth, cfg.heads, cfg.patch_size, cfg.qk_norm) == (16, 2, 2, 4, "rms_norm")
    kw = diffusers_kwargs(cfg)
    assert {k: list(v) if isinstance(v, tuple) else v for k, v in kw.items()} == SD3_KWARGS


# --------------------------------------------------------------------------- folders
def test_folder_sd3_loads_and_runs_as_diffusers_does(sd3_folder):
    """model.preset=folder: the run's transformer is the folder's, weight for weight, and its forward
    is diffusers' own call on the run's text features; a bare transformer/ folder reads the same."""
    from diffusers import SD3Transformer2DModel

    from pipelines.text2image import components
    from pipelines.text2image.diffusers_pipeline import init_from
    comp = components.build(t2i_cfg(*folder_overrides(sd3_folder)))
    assert comp.model.cfg.qk_norm == "rms_norm" and comp.model.cfg.hidden == 16
    assert "transformer of the pipeline folder" in init_from(comp, sd3_folder)
    theirs = SD3Transformer2DModel.from_pretrained(os.path.join(sd3_folder, "transformer")).eval()
    ours_model = comp.model.eval()
    for k, v in theirs.state_dict().items():
        assert torch.equal(ours_model.transformer.state_dict()[k], v), k
    ctx, mask = comp.text_encoder(["a red circle", "a small blue square"])
    assert not mask.all()
    x, t, _, _ = inputs()
    pooled = (ctx * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    with torch.no_grad():
        got = ours_model(x, t, ctx, mask)
        full = diffusers_call(theirs, x, t, ctx, pooled)
    torch.testing.assert_close(got, full, rtol=1e-6, atol=1e-6)
    assert got.std() > 1e-3
    bare = os.path.join(sd3_folder, "transformer")
    comp2 = components.build(t2i_cfg(*folder_overrides(bare)))
    assert "SD3 transformer folder" in init_from(comp2, bare)
    for k, v in theirs.state_dict().items():
        assert torch.equal(comp2.model.transformer.state_dict()[k], v), k


def test_folder_sd3_refusals(sd3_folder, tmp_path):
    from common.config import ConfigError
    from pipelines.text2image import components
    from pipelines.text2image.diffusers_pipeline import init_from
    from pipelines.text2image.export import build_pipeline, sd3_blockers
    from pipelines.text2image.sd3 import sd3_config_from_diffusers
    sizes = dict(img_size=128, in_channels=16, text_dim=4096, text_len=256)
    with pytest.raises(ValueError, match=r"pooled_projection_dim is 2048, .*\(text.width=4096\).*three text encoders"):
        sd3_config_from_diffusers(SD3_MEDIUM, **sizes)
    # With SD3's text stack (its CLIP-L + CLIP-G pooled width), SD3 Medium's own settings map.
    medium = sd3_config_from_diffusers(SD3_MEDIUM, **sizes, pooled_dim=2048)
    assert medium.pooled_dim == 2048 and medium.extra == {"pos_embed_max_size": 192}
    with pytest.raises(ValueError, match="pooled_projection_dim is 2048, while the CLIP encoders .* give .* 1536"):
        sd3_config_from_diffusers(SD3_MEDIUM, **sizes, pooled_dim=1536)
    fits = dict(SD3_MEDIUM, pooled_projection_dim=4096)
    assert sd3_config_from_diffusers(fits, **sizes).extra == {"pos_embed_max_size": 192}
    for change, named in [({"joint_attention_dim": 768}, "caption width .* is 768, while text.width=4096"),
                          ({"in_channels": 4, "out_channels": 4}, "4 to 4 channels, while .* has 16"),
                          ({"out_channels": 32}, "16 to 32 channels"),
                          ({"caption_projection_dim": 1152}, "caption_projection_dim=1152 differs"),
                          ({"pos_embed_max_size": 32}, "covers 32 patches a side, fewer than the 64"),
                          ({"_class_name": "PixArtTransformer2DModel"}, "not a SD3Transformer2DModel")]:
        with pytest.raises(ValueError, match=named):
            sd3_config_from_diffusers(dict(fits, **change), **sizes)
    with pytest.raises(ConfigError, match="model.preset=folder takes the SD3 transformer's architecture"):
        t2i_cfg("model.arch=sd3", "model.preset=folder")
    with pytest.raises(ConfigError, match="holds no SD3Transformer2DModel"):
        components.build(t2i_cfg(*folder_overrides(str(tmp_path))))
    with pytest.raises(ConfigError, match="caption width .* while text.width=64"):
        components.build(t2i_cfg(*folder_overrides(sd3_folder), "text.width=64"))
    with pytest.raises(ConfigError, match="model.hidden=64 sizes the DiT; model.arch=sd3 is sized by"):
        t2i_cfg(*folder_overrides(sd3_folder), "model.hidden=64")
    with pytest.raises(ConfigError, match="model.preset='xl' is not a sd3 preset"):
        t2i_cfg("model.arch=sd3", "model.preset=xl")
    for dim in ("tp", "cp", "pp"):
        with pytest.raises(ConfigError, match=f"parallel.{dim}=2 is not supported for text2image with model.arch=sd3"):
            t2i_cfg("model.arch=sd3", f"parallel.{dim}=2")
    # A preset run pointed at the folder: the architectures differ, and preset=folder is suggested.
    preset = components.build(t2i_cfg("model.arch=sd3"))
    with pytest.raises(ConfigError, match="model.preset=folder takes the folder's architecture"):
        init_from(preset, sd3_folder)
    # A DiT run pointed at an SD3 pipeline folder is told which arch reads it; export says why not.
    dit = components.build(t2i_cfg())
    with pytest.raises(ConfigError, match="holds a SD3Transformer2DModel .*model.arch=sd3 model.preset=folder"):
        init_from(dit, sd3_folder)
    with pytest.raises(ConfigError, match="model.arch=sd3 run exports as diffusers' own StableDiffusion3Pipeline"):
        build_pipeline(preset)
    # The stock SD3 pipeline names what a run lacks: SD3's own encoders and a VAE.
    assert [w.split(" (")[0] for w in sd3_blockers(preset)] == ["its text encoder is not SD3's three",
                                                               "it has no VAE"]
    with pytest.raises(ConfigError, match="--pipeline sd3: this run cannot be one"):
        build_pipeline(preset, "sd3")
    assert [w.split(" (")[0] for w in sd3_blockers(dit)] == [
        "its denoiser is not an SD3 transformer", "its text encoder is not SD3's three", "it has no VAE"]


# --------------------------------------------------------------------------- SD3's own text stack
CONTEXT = 8  # the stack's T5 tokens (SD3: 256); its CLIP tokenizers pad to 16 (SD3: 77)
# A tiny SD3 pipeline folder's transformer: T5 width 32 as the joint width, pooled CLIP-L + CLIP-G
# projections 8 + 8 (SD3: 4096 and 768 + 1280).
STACK_KWARGS = dict(sample_size=32, patch_size=4, in_channels=3, out_channels=3, num_layers=2, attention_head_dim=8,
                    num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=16,
                    pos_embed_max_size=8)


def make_sd3_stack_folder(folder: str, latent: bool = False) -> None:
    """An SD3 pipeline folder with its three text encoders: CLIP-L-like (width 8) and CLIP-G-like
    (width 16) CLIPTextModelWithProjection, a T5 encoder, their tokenizers, and a transformer on
    pixels; with `latent`, on the 16 x 16 x 4 latents of a tiny VAE with a shift, as SD3's."""
    from diffusers import SD3Transformer2DModel
    from transformers import AutoTokenizer

    from tests.test_t2i_diffusers import make_clip, make_t5
    from tests.test_t2i_sd_folder import make_vae
    for sub, width in [("", 8), ("_2", 16)]:
        make_clip(os.path.join(folder, f"text_encoder{sub}"), width=width, projection_dim=8)
        AutoTokenizer.from_pretrained(os.path.join(folder, f"text_encoder{sub}")).save_pretrained(
            os.path.join(folder, f"tokenizer{sub}"))
    make_t5(os.path.join(folder, "text_encoder_3"), width=32)
    AutoTokenizer.from_pretrained(os.path.join(folder, "text_encoder_3")).save_pretrained(
        os.path.join(folder, "tokenizer_3"))
    torch.manual_seed(6)
    latents = dict(sample_size=16, patch_size=2, in_channels=4, out_channels=4) if latent else {}
    SD3Transformer2DModel(**{**STACK_KWARGS, **latents}).save_pretrained(os.path.join(folder, "transformer"))
    if latent:
        vae = make_vae()
        vae.register_to_config(shift_factor=0.1, scaling_factor=1.2)
        vae.save_pretrained(os.path.join(folder, "vae"))
    json.dump({"_class_name": "StableDiffusion3Pipeline", "transformer": ["diffusers", "SD3Transformer2DModel"],
               **{f"text_encoder{s}": ["transformers", "CLIPTextModelWithProjection"] for s in ("", "_2")},
               "text_encoder_3": ["transformers", "T5EncoderModel"]},
              open(os.path.join(folder, "model_index.json"), "w"))


@pytest.fixture(scope="module")
def sd3_stack_folder(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("sd3stack") / "sd3")
    make_sd3_stack_folder(folder)
    return folder


@pytest.fixture(scope="module")
def sd3_latent_folder(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("sd3latent") / "sd3")
    make_sd3_stack_folder(folder, latent=True)
    return folder


def stack_overrides(folder: str) -> list[str]:
    return [*folder_overrides(folder), f"text.hf_path={folder}", "text.width=32", f"text.context_length={CONTEXT}"]


def diffusers_sd3_conditioning(folder: str, prompts: list[str]):
    """(prompt_embeds, pooled_prompt_embeds) of diffusers' own StableDiffusion3Pipeline.encode_prompt
    on the folder's three encoders."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel
    parts = {f"text_encoder{s}": CLIPTextModelWithProjection.from_pretrained(os.path.join(folder, f"text_encoder{s}"))
             for s in ("", "_2")}
    parts["text_encoder_3"] = T5EncoderModel.from_pretrained(os.path.join(folder, "text_encoder_3"))
    for s in ("", "_2", "_3"):
        parts[f"tokenizer{s}"] = AutoTokenizer.from_pretrained(os.path.join(folder, f"tokenizer{s}"))
    transformer = SD3Transformer2DModel.from_pretrained(os.path.join(folder, "transformer"))
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), vae=None,
                                    **parts)
    with torch.no_grad():  # as its __call__ runs it (recording autograd, it differed by up to 3.6e-7)
        embeds, _, pooled, _ = pipe.encode_prompt(prompts, None, None, device="cpu", do_classifier_free_guidance=False,
                                                  max_sequence_length=CONTEXT)
    return embeds, pooled


def test_sd3_text_stack_encodes_as_diffusers_pipeline(sd3_stack_folder):
    """text.hf_path = an SD3 pipeline folder builds SD3's stack, whose output is diffusers' own
    encode_prompt: row 0 the pooled CLIP-L + CLIP-G vector (zeros after its 16 features), then the
    CLIP tokens (penultimate layers, zero-padded to T5's width) and the T5 tokens; nothing masked."""
    from common.nn.text_encoder import SD3TextEncoders
    from pipelines.text2image import components
    comp = components.build(t2i_cfg(*stack_overrides(sd3_stack_folder)))
    enc = comp.text_encoder
    assert isinstance(enc, SD3TextEncoders) and enc.pooled_width == 16 and enc.num_positions == 1 + 16 + CONTEXT
    tokens, mask = enc(PROMPTS)
    embeds, pooled = diffusers_sd3_conditioning(sd3_stack_folder, PROMPTS)
    assert tokens.shape == (2, 1 + 16 + CONTEXT, 32) and mask.all()
    torch.testing.assert_close(tokens[:, 1:], embeds, rtol=0, atol=0)
    torch.testing.assert_close(tokens[:, 0, :16], pooled, rtol=0, atol=0)
    assert not tokens[:, 0, 16:].any() and pooled.std() > 1e-3
    assert (tokens[0, 1:] - tokens[1, 1:]).abs().max() > 1e-3  # the captions differ
    # The folder's transformer, fed by the stack, is diffusers' call with SD3's own conditioning.
    from diffusers import SD3Transformer2DModel

    from pipelines.text2image.diffusers_pipeline import init_from
    assert comp.model.cfg.pooled_dim == 16
    init_from(comp, sd3_stack_folder)
    theirs = SD3Transformer2DModel.from_pretrained(os.path.join(sd3_stack_folder, "transformer")).eval()
    x, t, _, _ = inputs()
    with torch.no_grad():
        got = comp.model.eval()(x, t, tokens, mask)
        full = diffusers_call(theirs, x, t, embeds, pooled)
    torch.testing.assert_close(got, full, rtol=1e-6, atol=1e-6)
    assert got.std() > 1e-3


def test_sd3_text_stack_in_bf16(sd3_stack_folder):
    """text.dtype=bf16: the stack's three encoders hold bf16 weights and give fp32 features within
    bf16 rounding of the fp32 stack's, the pooled row's zero padding kept."""
    from common.config import TextConfig
    from common.nn.text_encoder import build_text_encoder
    cfg = dict(width=32, context_length=CONTEXT, hf_path=sd3_stack_folder)
    ref = build_text_encoder(TextConfig(**cfg), run_seed=0, sd3_stack=True)
    half = build_text_encoder(TextConfig(**cfg, dtype="bf16"), run_seed=0, sd3_stack=True)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    (a, _), (b, mask) = ref(PROMPTS), half(PROMPTS)
    assert b.dtype == torch.float32 and b.shape == a.shape and mask.all()
    assert 0 < ((a - b).norm() / a.norm()).item() < 2e-2 and not b[:, 0, 16:].any()


def test_sd3_fine_tune_on_precomputed_stack_features(sd3_stack_folder, synth_data, tmp_path):
    """data.precompute --text-hf-path = the SD3 folder stores the stack's features (pooled row,
    CLIP and T5 tokens: 1 + 16 + CONTEXT rows), and an SD3 fine-tune on them trains as one that
    runs the stack, to float16 rounding of the features."""
    from data import precompute
    data = tmp_path / "data"
    assert precompute.main([os.path.join(synth_data, "train"), "--out", str(data / "train"), "--device", "cpu",
                            "--no-progress", "--text-encoder", "--text-hf-path", sd3_stack_folder,
                            "--text-context-length", str(CONTEXT)]) == 0
    os.symlink(os.path.join(synth_data, "heldout"), data / "heldout")
    for name, shards in (("stack", synth_data), ("stored", str(data))):
        run_checked(train_cmd() + [
            "--config", TINY_YAML, f"run.dir={tmp_path / name}", f"data.train_shards={shards}/train",
            f"data.eval_shards={shards}/heldout", *stack_overrides(sd3_stack_folder), "train.progress=false",
            "data.num_workers=0", *FAST, "train.log_every=1"])
    assert_same_losses_to_rounding(str(tmp_path / "stack"), str(tmp_path / "stored"), [1, 2, 3])


def test_sd3_folder_pooled_width_needs_its_text_stack(sd3_stack_folder):
    """The same folder with a single tower (no SD3 stack): its 16-wide pooled projection cannot take
    the tower's mean, and the refusal says which text.hf_path gives SD3's pooled features. The
    stack itself feeds SD3 only: another denoiser would read its pooled row as a caption token."""
    from common.config import ConfigError
    from pipelines.text2image import components
    with pytest.raises(ConfigError, match="pooled_projection_dim is 16, while the pooled vector of this text tower is "
                                          "the mean of its features .text.width=32.; .* set text.hf_path to the SD3"):
        components.build(t2i_cfg(*folder_overrides(sd3_stack_folder), "text.width=32"))
    with pytest.raises(ConfigError, match="is a Stable Diffusion 3 pipeline folder: .* SD3 transformer only"):
        components.build(t2i_cfg(f"text.hf_path={sd3_stack_folder}", "text.width=32"))


def test_vae_shift_factor_as_sd3_pipeline(tmp_path):
    """A VAE with a shift_factor (SD3's) gives the model (latent - shift) * scale, precomputed or
    encoded on the fly, and sampling decodes x / scale + shift, as diffusers' SD3 pipeline does."""
    from pipelines.text2image import components
    from tests.test_t2i_sd_folder import make_vae
    vae = make_vae()
    vae.register_to_config(shift_factor=0.25, scaling_factor=1.5)
    vae.save_pretrained(str(tmp_path / "vae"))
    comp = components.build(t2i_cfg(f"vae.path={tmp_path}/vae", "model.patch_size=2"))
    lat = torch.randn(2, 4, 16, 16)
    got = components.encode_images(comp, {"latent": lat}, "cpu")
    torch.testing.assert_close(got, (lat - 0.25) * 1.5, rtol=0, atol=0)
    torch.testing.assert_close(comp.from_model_space(got), lat, rtol=1e-6, atol=1e-6)
    from common.diffusion import noise as dnoise
    images, positions = torch.rand(2, 3, 32, 32) * 2 - 1, torch.arange(2)
    with torch.no_grad():
        posterior = comp.vae.encode(images).latent_dist
    eps = dnoise.per_sample_randn(dnoise.sample_seeds(comp.cfg.run.seed, positions), posterior.mean.shape[1:],
                                  components.SALT_LATENT)
    drawn = components.encode_images(comp, {"image": images, "__position__": positions}, "cpu")
    torch.testing.assert_close(drawn, (posterior.mean + posterior.std * eps - 0.25) * 1.5, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- fine-tune and sample
@pytest.mark.parametrize("text", ["tower", "sd3_stack"])
def test_fine_tune_folder_sd3_and_sample(text, request, synth_data, tmp_path):
    """Three flow-matching steps from the folder's weights (with the run's tower, or with SD3's own
    text stack from its folder); the run's weights moved off them, and sample.py draws from the run
    exactly what the library's generate draws."""
    import torch.distributed.checkpoint as dcp
    from diffusers import SD3Transformer2DModel

    from common.run import load_run
    from pipelines.text2image.spec import SPEC
    run, out = str(tmp_path / "run"), str(tmp_path / "samples")
    sd3_folder = request.getfixturevalue("sd3_folder" if text == "tower" else "sd3_stack_folder")
    overrides = folder_overrides(sd3_folder) if text == "tower" else stack_overrides(sd3_folder)
    run_checked(train_cmd() + [
        "--config", TINY_YAML, f"run.dir={run}", f"data.train_shards={synth_data}/train",
        f"data.eval_shards={synth_data}/heldout", *overrides, "train.progress=false", "data.num_workers=0", *FAST])
    comp, meta = load_run(SPEC, run)
    # The run's random tower is saved with the checkpoint; SD3's stack is fingerprinted, not saved.
    saved = dcp.FileSystemReader(meta["path"]).read_metadata().state_dict_metadata
    assert any(k.startswith("text_encoder.") for k in saved) == (text == "tower")
    start = SD3Transformer2DModel.from_pretrained(os.path.join(sd3_folder, "transformer"))
    moved = max((comp.model.transformer.state_dict()[k] - v).abs().max().item() for k, v in start.state_dict().items())
    assert moved > 1e-4
    _, ref = ours(comp)
    assert ref.float().std() > 5
    for prompt, seed, image in zip(PROMPTS, SEEDS, ref):
        proc = run_module("pipelines.text2image.sample", "--run", run, "--prompt", prompt, "--out", out,
                          "--seed", str(seed), "--steps", str(STEPS), "--cfg", str(CFG))
        assert proc.returncode == 0, proc.stderr[-3000:]
        (entry,) = [json.loads(line) for line in open(os.path.join(out, "index.jsonl"))]
        assert (entry["prompt"], entry["seed"]) == (prompt, seed)
        got = torch.from_numpy(np.array(Image.open(os.path.join(out, entry["file"]))))
        assert torch.equal(got, image), prompt
        shutil.rmtree(out)


def test_fine_tune_sd3_exports_stock_pipeline(sd3_latent_folder, synth_data, tmp_path):
    """Three steps of an SD3 fine-tune (its text stack, a VAE with a shift), then --pipeline sd3:
    diffusers' own StableDiffusion3Pipeline, loaded without the project's code, draws the images
    sample.py draws from the same noise and (unshifted) sigmas, with the run's T5 length."""
    from diffusers import StableDiffusion3Pipeline

    from common.diffusion.diffusers_parts import seeded_noise
    from common.run import load_run
    from pipelines.text2image.spec import SPEC
    run, out = str(tmp_path / "run"), str(tmp_path / "export")
    run_checked(train_cmd() + [
        "--config", TINY_YAML, f"run.dir={run}", f"data.train_shards={synth_data}/train",
        f"data.eval_shards={synth_data}/heldout", *stack_overrides(sd3_latent_folder),
        f"vae.path={sd3_latent_folder}/vae", "train.progress=false", "data.num_workers=0", *FAST])
    comp, _ = load_run(SPEC, run)
    assert comp.latent_shift == pytest.approx(0.1) and comp.latent_channels == 4
    proc = run_module("pipelines.text2image.export", "--run", run, "--out", out, "--pipeline", "sd3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trust_remote_code" not in proc.stdout and not os.path.exists(os.path.join(out, "pipeline.py"))
    assert json.load(open(os.path.join(out, "model_index.json")))["_class_name"] == "StableDiffusion3Pipeline"
    assert f"max_sequence_length={CONTEXT}" in open(os.path.join(out, "README.md")).read()
    pipe = StableDiffusion3Pipeline.from_pretrained(out)
    noise = seeded_noise(len(PROMPTS), (4, 16, 16), None, SEEDS[0], None, "cpu", torch.float32)
    got = pipe(PROMPTS, sigmas=np.linspace(1.0, 0.0, STEPS + 1)[:-1].tolist(), guidance_scale=CFG, latents=noise,
               output_type="pt", max_sequence_length=CONTEXT, height=32, width=32).images
    ref, _ = ours(comp)
    diff = (got * 2 - 1 - ref).abs().max().item()
    print(f"StableDiffusion3Pipeline vs sample.py: max abs diff {diff:.2e} on [-1, 1]")
    assert diff < 1e-4 and ref.std() > 0.05
    proc = run_module("pipelines.text2image.export", "--run", run, "--out", str(tmp_path / "project"))
    assert proc.returncode != 0 and "--pipeline sd3" in proc.stderr


# --------------------------------------------------------------------------- data parallelism
@pytest.fixture(scope="module")
def single_sd3_run(synth_data, tmp_path_factory):
    return shared_once(tmp_path_factory, "sd3-single", lambda run: run_transformer(
        "sd3", run, synth_data, "data.micro_batch_size=8"))


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_data_parallel_matches_single_process(single_sd3_run, synth_data, tmp_path, layout):
    """DDP, and FSDP2 over SD3's joint blocks with full activation checkpointing, 2 ranks, equal one
    process: losses and grad norms per step, final weights and EMA weights."""
    assert_layout_trains_as_one_process("sd3", single_sd3_run, synth_data, str(tmp_path / "run"), layout)
