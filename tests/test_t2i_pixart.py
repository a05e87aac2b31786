"""text2image with model.arch=pixart (pipelines/text2image/pixart.py): diffusers' PixArt transformer
behind the DiT's interface. Its forward equals diffusers' own call with PixArt's conditioning;
model.preset=folder builds a PixArt folder's exact transformer (PixArt-alpha 1024's resolution
conditions and learned sigma included) and model.init_from loads its weights; folders the
pipeline cannot drive are refused with the setting named; a fine-tuned run exports as diffusers'
own PixArtAlphaPipeline, which draws what sample.py draws; data parallelism equals one process."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import (ROOT, assert_same_final_weights, assert_same_training, run_checked, run_module,
                            shared_once, train_cmd)
from tests.test_t2i_diffusers import FAST, make_t5
from tests.test_t2i_sd_folder import make_vae

WIDTH, CONTEXT = 32, 16
TINY_YAML = os.path.join(ROOT, "pipelines/text2image/configs/tiny.yaml")
# A small PixArt transformer on the tiny VAE's 16x16x4 latents: learned sigma (8 output channels),
# as PixArt's published checkpoints, with caption_channels = the tiny T5's width.
PIXART_KWARGS = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
                     cross_attention_dim=16, caption_channels=WIDTH, sample_size=16, patch_size=2)
# PixArt-alpha XL-2-1024-MS's and PixArt-Sigma XL-2-512-MS's transformer settings (their
# transformer/config.json, bookkeeping keys aside): alpha 1024 leaves use_additional_conditions
# unset (diffusers turns it on for sample_size 128), Sigma sets it off and interpolation_scale.
ALPHA_1024 = dict(activation_fn="gelu-approximate", attention_bias=True, attention_head_dim=72, caption_channels=4096,
                  cross_attention_dim=1152, dropout=0.0, in_channels=4, norm_elementwise_affine=False,
                  norm_eps=1e-6, norm_num_groups=32, norm_type="ada_norm_single", num_attention_heads=16,
                  num_embeds_ada_norm=1000, num_layers=28, out_channels=8, patch_size=2, sample_size=128,
                  upcast_attention=False)
SIGMA_512 = dict(ALPHA_1024, sample_size=64, interpolation_scale=None, use_additional_conditions=False)


def make_pixart_folder(folder: str) -> None:
    """A diffusers pipeline folder as PixArt's is laid out: model_index.json, transformer/ (random
    weights, proj_out too, so that a load that silently kept the run's init would show), vae/,
    and text_encoder/ + tokenizer/ (a tiny T5)."""
    from diffusers import PixArtTransformer2DModel
    torch.manual_seed(3)
    PixArtTransformer2DModel(**PIXART_KWARGS).save_pretrained(os.path.join(folder, "transformer"))
    make_vae().save_pretrained(os.path.join(folder, "vae"))
    make_t5(os.path.join(folder, "text_encoder"), width=WIDTH)
    os.makedirs(os.path.join(folder, "tokenizer"))
    for name in os.listdir(os.path.join(folder, "text_encoder")):
        if name.startswith(("tokenizer", "special_tokens", "spiece")):
            os.rename(os.path.join(folder, "text_encoder", name), os.path.join(folder, "tokenizer", name))
    json.dump({"_class_name": "PixArtAlphaPipeline", "transformer": ["diffusers", "PixArtTransformer2DModel"],
               "text_encoder": ["transformers", "T5EncoderModel"], "tokenizer": ["transformers", "T5Tokenizer"]},
              open(os.path.join(folder, "model_index.json"), "w"))


@pytest.fixture(scope="module")
def pixart_folder(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("pixart") / "pixart")
    make_pixart_folder(folder)
    return folder


def folder_overrides(folder: str) -> list[str]:
    """A PixArt fine-tune's settings (configs/pixart_finetune.yaml's) on the tiny folder."""
    return ["model.arch=pixart", "model.preset=folder", f"model.init_from={folder}", "model.image_size=32",
            f"vae.path={folder}/vae", f"text.hf_path={folder}/text_encoder", f"text.width={WIDTH}",
            f"text.context_length={CONTEXT}", "diffusion.objective=ddpm", "diffusion.ddpm_schedule=linear"]


def folder_cfg(folder: str, *overrides: str):
    from common.config import build_config
    from pipelines.text2image.config import T2IConfig
    return build_config(T2IConfig, TINY_YAML, [*folder_overrides(folder), *overrides])


def tiny_pixart(**overrides):
    from pipelines.text2image.pixart import PixArt, pixart_config
    torch.manual_seed(0)
    model = PixArt(pixart_config("tiny", text_dim=WIDTH, text_len=8, **overrides))
    with torch.no_grad():  # the zero-initialised output would make every comparison trivially equal
        for p in model.parameters():
            if not p.any():
                p.normal_(0, 0.05)
    return model.eval()


def inputs(batch: int = 2, seed: int = 1, channels: int = 3, size: int = 32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, size, size, generator=g)
    t = torch.rand(batch, generator=g)
    ctx = torch.randn(batch, 8, WIDTH, generator=g)
    mask = torch.ones(batch, 8, dtype=torch.bool)
    mask[0, 5:] = False
    mask[1, 3:] = False
    return x, t, ctx, mask


# --------------------------------------------------------------------------- the model
def test_tiny_pixart_is_diffusers_called_with_pixart_conditioning():
    """The wrapper's forward is PixArtTransformer2DModel's at t * 1000 with the caption's padding
    mask; the untrained model predicts 0, as the DiT; the padding is masked (the padded tokens'
    features do not reach the output)."""
    from pipelines.text2image.pixart import PixArt, pixart_config
    untrained = PixArt(pixart_config("tiny", text_dim=WIDTH))
    assert torch.all(untrained(*inputs()) == 0)
    model = tiny_pixart()
    x, t, ctx, mask = inputs()
    with torch.no_grad():
        got = model(x, t, ctx, mask)
        direct = model.transformer(x, encoder_hidden_states=ctx, timestep=t * 1000,
                                   added_cond_kwargs={"resolution": None, "aspect_ratio": None},
                                   encoder_attention_mask=mask.float(), return_dict=False)[0]
        noisy = ctx.clone()
        noisy[~mask] = 100 * torch.randn(int((~mask).sum()), WIDTH)
        unmasked = model(x, t, ctx, None)
    torch.testing.assert_close(got, direct, rtol=0, atol=0)
    torch.testing.assert_close(model(x, t, noisy, mask), got, atol=1e-5, rtol=1e-5)
    assert (unmasked - got).abs().max() > 1e-4  # the mask mattered
    assert got.std() > 1e-3


def test_pixart_size_fields_and_flops():
    from pipelines.text2image.pixart import PixArt, pixart_config
    with torch.device("meta"):
        xl = PixArt(pixart_config("xl"))
    # PixArt-alpha XL/2: 28 blocks of width 1152 over T5-XXL features, learned sigma.
    assert xl.transformer.config.out_channels == 8 and len(xl.blocks) == 28
    assert sum(p.numel() for p in xl.parameters()) > 600e6
    small = tiny_pixart()
    wide = tiny_pixart(hidden=256, heads=8)
    assert wide.flops_per_sample() > 3 * small.flops_per_sample() > 0


@pytest.mark.parametrize("config", [ALPHA_1024, SIGMA_512], ids=["alpha1024", "sigma512"])
def test_pixart_configs_map_to_the_same_transformer(config):
    """PixArt-alpha 1024's and Sigma 512's settings give back exactly their transformer (meta device)."""
    from diffusers import PixArtTransformer2DModel

    from pipelines.text2image.pixart import diffusers_config_mismatch, diffusers_kwargs, pixart_config_from_diffusers
    pcfg = pixart_config_from_diffusers(config, img_size=config["sample_size"], in_channels=4, text_dim=4096,
                                        text_len=120, image_size=8 * config["sample_size"])
    assert pcfg.learned_sigma and pcfg.hidden == 1152 and pcfg.depth == 28
    with torch.device("meta"):
        model = PixArtTransformer2DModel(**diffusers_kwargs(pcfg))
    assert diffusers_config_mismatch(model, config) == []
    assert model.use_additional_conditions == (config is ALPHA_1024)
    with torch.device("meta"):  # the check that guards the mapping can fail
        lost = PixArtTransformer2DModel(**dict(diffusers_kwargs(pcfg), use_additional_conditions=False))
    assert diffusers_config_mismatch(lost, config) == ([] if config is SIGMA_512 else
                                                       ["use_additional_conditions: folder True vs built False"])


def test_resolution_conditions_are_fed_for_1024_models():
    """A transformer with resolution conditions (PixArt-alpha 1024) gets the image side and aspect
    ratio 1, as PixArtAlphaPipeline gives them for square images."""
    from pipelines.text2image.pixart import PixArt, PixArtConfig
    torch.manual_seed(0)
    # (width divisible by 3: diffusers splits it between the timestep and the two conditions)
    model = PixArt(PixArtConfig(text_dim=WIDTH, hidden=144, image_size=256,
                                extra={"use_additional_conditions": True})).eval()
    torch.nn.init.normal_(model.transformer.proj_out.weight, std=0.05)
    x, t, ctx, mask = inputs()
    with torch.no_grad():
        got = model(x, t, ctx, mask)
        res = torch.tensor([[256.0, 256.0]] * 2)
        direct = model.transformer(x, encoder_hidden_states=ctx, timestep=t * 1000, encoder_attention_mask=mask.float(),
                                   added_cond_kwargs={"resolution": res, "aspect_ratio": torch.ones(2, 1)},
                                   return_dict=False)[0]
        other = model.transformer(x, encoder_hidden_states=ctx, timestep=t * 1000, encoder_attention_mask=mask.float(),
                                  added_cond_kwargs={"resolution": res / 2, "aspect_ratio": torch.ones(2, 1)},
                                  return_dict=False)[0]
    torch.testing.assert_close(got, direct, rtol=0, atol=0)
    assert (other - direct).abs().max() > 1e-5


# --------------------------------------------------------------------------- folders in
def test_folder_pixart_loads_and_runs_as_diffusers_does(pixart_folder):
    """model.preset=folder: the run's transformer is the folder's, weight for weight, its forward
    is the noise half of diffusers' own call, and the T5 features are the folder's T5 with the
    padding mask (as PixArt's pipelines compute them)."""
    from diffusers import PixArtTransformer2DModel

    from pipelines.text2image import components
    from pipelines.text2image.diffusers_pipeline import init_from
    comp = components.build(folder_cfg(pixart_folder))
    assert comp.model.cfg.learned_sigma and comp.model.cfg.hidden == 16 and comp.latent_size == 16
    assert "transformer" in init_from(comp, pixart_folder)
    theirs = PixArtTransformer2DModel.from_pretrained(os.path.join(pixart_folder, "transformer")).eval()
    ours = comp.model.eval()
    for k, v in theirs.state_dict().items():
        assert torch.equal(ours.transformer.state_dict()[k], v), k
    ctx, mask = comp.text_encoder(["a red circle", "a small blue square"])
    assert not mask.all() and comp.text_encoder.padding_mask
    x, t, _, _ = inputs(channels=4, size=16)
    with torch.no_grad():
        got = ours(x, t, ctx, mask)
        full = theirs(x, encoder_hidden_states=ctx, timestep=t * 1000, encoder_attention_mask=mask.float(),
                      added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False)[0]
    assert full.shape[1] == 8
    torch.testing.assert_close(got, full[:, :4], rtol=0, atol=0)
    # The bare transformer/ folder (no model_index.json) is read the same way.
    bare = components.build(folder_cfg(pixart_folder, f"model.init_from={pixart_folder}/transformer"))
    assert "PixArt transformer folder" in init_from(bare, os.path.join(pixart_folder, "transformer"))
    for k, v in theirs.state_dict().items():
        assert torch.equal(bare.model.transformer.state_dict()[k], v), k


def test_folder_pixart_refusals(pixart_folder, tmp_path):
    from common.config import ConfigError, build_config
    from pipelines.text2image import components
    from pipelines.text2image.config import T2IConfig
    from pipelines.text2image.diffusers_pipeline import init_from
    from pipelines.text2image.export import build_pipeline, pixart_blockers
    from pipelines.text2image.pixart import pixart_config_from_diffusers
    sizes = dict(img_size=64, in_channels=4, text_dim=4096, text_len=120, image_size=512)
    for change, named in [({"norm_type": "ada_norm_zero"}, "norm_type='ada_norm_zero' is not supported"),
                          ({"in_channels": 8, "out_channels": 16}, "8 to 16 channels"),
                          ({"caption_channels": 768}, "caption_channels is 768, while text.width=4096"),
                          ({"attention_type": "gated"}, "attention_type='gated'"),
                          ({"_class_name": "SD3Transformer2DModel"}, "not a PixArtTransformer2DModel")]:
        with pytest.raises(ValueError, match=named):
            pixart_config_from_diffusers(dict(SIGMA_512, **change), **sizes)
    with pytest.raises(ConfigError, match="model.preset=folder takes the PixArt transformer's architecture"):
        folder_cfg(pixart_folder, "model.init_from=''")
    with pytest.raises(ConfigError, match="holds no PixArtTransformer2DModel"):
        components.build(folder_cfg(pixart_folder, f"model.init_from={tmp_path}"))
    with pytest.raises(ConfigError, match="model.hidden=64 sizes the DiT; model.arch=pixart is sized by"):
        folder_cfg(pixart_folder, "model.hidden=64")
    with pytest.raises(ConfigError, match="model.mlp_ratio=2.0 sizes the DiT"):
        build_config(T2IConfig, TINY_YAML, ["model.arch=pixart", "model.mlp_ratio=2"])
    with pytest.raises(ConfigError, match="parallel.tp=2 is not supported for text2image with model.arch=pixart"):
        folder_cfg(pixart_folder, "parallel.tp=2")
    # A preset run pointed at the folder: the architectures differ, and preset=folder is suggested.
    preset = components.build(folder_cfg(pixart_folder, "model.preset=tiny"))
    with pytest.raises(ConfigError, match="model.preset=folder takes the folder's architecture"):
        init_from(preset, pixart_folder)
    # A DiT run pointed at a PixArt pipeline folder is told which arch reads it.
    dit = components.build(build_config(T2IConfig, TINY_YAML, [f"text.width={WIDTH}", "model.patch_size=2",
                                                               f"vae.path={pixart_folder}/vae"]))
    with pytest.raises(ConfigError, match="holds a PixArtTransformer2DModel .*model.arch=pixart model.preset=folder"):
        init_from(dit, pixart_folder)
    # Export: the project's pipeline refuses a PixArt run with the way that works; the stock
    # PixArt pipeline names what a run lacks.
    comp = components.build(folder_cfg(pixart_folder))
    assert pixart_blockers(comp) == []
    with pytest.raises(ConfigError, match="--pipeline pixart"):
        build_pipeline(comp)
    unmasked = components.build(folder_cfg(pixart_folder, "text.hf_padding_mask=false"))
    assert pixart_blockers(unmasked) == ["its text encoder is not a Hugging Face one run with the padding mask "
                                         "(text.hf_path, text.hf_padding_mask=true)"]
    with pytest.raises(ConfigError, match="--pipeline pixart: this run cannot be one"):
        build_pipeline(unmasked, "pixart")
    assert [w.split(" (")[0] for w in pixart_blockers(dit)] == [
        "its denoiser is not a PixArt transformer", "its text encoder is not a Hugging Face one run with the padding mask",
        "its objective is not DDPM"]  # flow: the stock pipeline's loop needs a DDPM scheduler's init_noise_sigma


# --------------------------------------------------------------------------- fine-tune and export
def test_fine_tune_folder_pixart_exports_stock_pipeline(pixart_folder, synth_data, tmp_path):
    """Three DDPM steps from the folder's weights, then --pipeline pixart: diffusers' own
    PixArtAlphaPipeline, loaded without the project's code, draws the images sample.py draws from
    the same noise and timesteps, with the run's caption length."""
    from diffusers import PixArtAlphaPipeline, PixArtTransformer2DModel

    from common.diffusion.diffusers_parts import seeded_noise
    from common.diffusion.samplers import ddim_timesteps
    from common.run import load_run
    from pipelines.text2image.spec import SPEC
    from tests.test_t2i_diffusers import CFG, PROMPTS, SEEDS, STEPS, ours
    run, out = str(tmp_path / "run"), str(tmp_path / "export")
    run_checked(train_cmd() + [
        "--config", TINY_YAML, f"run.dir={run}", f"data.train_shards={synth_data}/train",
        f"data.eval_shards={synth_data}/heldout", *folder_overrides(pixart_folder),
        "train.progress=false", "data.num_workers=0", *FAST])
    comp, _ = load_run(SPEC, run)
    start = PixArtTransformer2DModel.from_pretrained(os.path.join(pixart_folder, "transformer"))
    moved = max((comp.model.transformer.state_dict()[k] - v).abs().max().item() for k, v in start.state_dict().items())
    assert moved > 1e-4  # trained from the folder's weights, not left there
    proc = run_module("pipelines.text2image.export", "--run", run, "--out", out, "--pipeline", "pixart")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trust_remote_code" not in proc.stdout and not os.path.exists(os.path.join(out, "pipeline.py"))
    index = json.load(open(os.path.join(out, "model_index.json")))
    assert index["_class_name"] == "PixArtAlphaPipeline"
    assert "max_sequence_length=16" in open(os.path.join(out, "README.md")).read()
    pipe = PixArtAlphaPipeline.from_pretrained(out)
    assert pipe.transformer.config.out_channels == 8
    noise = seeded_noise(len(PROMPTS), (4, 16, 16), None, SEEDS[0], None, "cpu", torch.float32)
    got = pipe(PROMPTS, timesteps=ddim_timesteps(1000, STEPS), guidance_scale=CFG, latents=noise, output_type="pt",
               max_sequence_length=CONTEXT, clean_caption=False, use_resolution_binning=False,
               height=32, width=32).images
    ref, _ = ours(comp)
    diff = (got * 2 - 1 - ref).abs().max().item()
    print(f"PixArtAlphaPipeline vs sample.py: max abs diff {diff:.2e} on [-1, 1]")
    assert diff < 1e-4 and ref.std() > 0.05
    proc = run_module("pipelines.text2image.export", "--run", run, "--out", str(tmp_path / "project"))
    assert proc.returncode != 0 and "--pipeline pixart" in proc.stderr


# --------------------------------------------------------------------------- data parallelism
STEPS_DP = 5
EQUIV = [f"train.steps={STEPS_DP}", "train.log_every=1", "train.ckpt_every=100", "train.sample_every=0",
         "sample.num=0", "train.ema_decay=0.9", "text.width=32", "text.layers=1", "text.heads=2",
         "text.context_length=16", "train.progress=false", "data.num_workers=0"]
LAYOUTS = {
    "ddp": ["data.micro_batch_size=4", "parallel.dp_mode=ddp"],
    "fsdp-ac-full": ["data.micro_batch_size=4", "parallel.dp_mode=fsdp", "parallel.activation_checkpoint=full"],
}


def run_transformer(arch: str, run_dir: str, data_dir: str, *overrides: str, nproc: int = 1):
    """A short tiny.yaml run of model.arch=`arch` (pixart, or sd3: tests/test_t2i_sd3.py) for the
    data-parallel equivalence checks."""
    return run_checked(train_cmd(nproc) + ["--config", TINY_YAML, f"run.dir={run_dir}",
                                           f"data.train_shards={data_dir}/train",
                                           f"data.eval_shards={data_dir}/heldout", f"model.arch={arch}", *EQUIV,
                                           *overrides])


@pytest.fixture(scope="module")
def single_pixart_run(synth_data, tmp_path_factory):
    return shared_once(tmp_path_factory, "pixart-single", lambda run: run_transformer(
        "pixart", run, synth_data, "data.micro_batch_size=8"))


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_data_parallel_matches_single_process(single_pixart_run, synth_data, tmp_path, layout):
    """DDP, and FSDP2 over PixArt's blocks with full activation checkpointing, 2 ranks, equal one
    process: losses and grad norms per step, final weights and EMA weights."""
    assert_layout_trains_as_one_process("pixart", single_pixart_run, synth_data, str(tmp_path / "run"), layout)


def assert_layout_trains_as_one_process(arch: str, single_run: str, data_dir: str, run: str, layout: str) -> None:
    """A 2-rank run of model.arch=`arch` under LAYOUTS[layout] logs the losses and grad norms of
    `single_run` (one process) and ends with its weights and EMA weights (the transformer blocks)."""
    from pipelines.text2image.spec import SPEC
    run_transformer(arch, run, data_dir, *LAYOUTS[layout], nproc=2)
    assert_same_training(single_run, run, range(1, STEPS_DP + 1))
    assert_same_final_weights(SPEC, single_run, run, STEPS_DP, prefix="transformer.transformer_blocks.")
