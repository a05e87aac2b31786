"""Fine-tuning a Stable-Diffusion-style UNet from a local diffusers folder: model.preset=folder
builds the folder's exact UNet2DConditionModel (settings the presets do not have included) and
model.init_from loads its weights; SD's scaled_linear betas; SD's text conditioning (CLIP run on
the padded caption without a mask, every position attended); the trained run exports as our
pipeline and as diffusers' own StableDiffusionPipeline, both drawing what sample.py draws; folders
the pipeline cannot drive are refused with the setting named; fp16-only folders load in fp32."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import ROOT, run_checked, run_module, train_cmd
from tests.test_t2i_diffusers import FAST, assert_same_images, make_clip

WIDTH, CONTEXT = 32, 16
# A small UNet unlike every preset: two levels, attention at the first only, one int for the
# heads (SD1.x's form), linear projections, and settings the presets leave at diffusers'
# defaults (upcast_attention as SD2.1's folder sets it, scale-shift time conditioning).
UNET_KWARGS = dict(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(16, 32),
                   down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                   up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), layers_per_block=1, norm_num_groups=8,
                   attention_head_dim=2, cross_attention_dim=WIDTH, use_linear_projection=True,
                   upcast_attention=True, resnet_time_scale_shift="scale_shift")

# Stable Diffusion 1.x's and 2.x's UNet settings (their unet/config.json, minus bookkeeping keys).
SD15 = dict(act_fn="silu", attention_head_dim=8, block_out_channels=[320, 640, 1280, 1280], center_input_sample=False,
            cross_attention_dim=768, down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
            downsample_padding=1, flip_sin_to_cos=True, freq_shift=0, in_channels=4, layers_per_block=2,
            mid_block_scale_factor=1, norm_eps=1e-05, norm_num_groups=32, out_channels=4, sample_size=64,
            up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3)
SD21 = dict(SD15, attention_head_dim=[5, 10, 20, 20], cross_attention_dim=1024, use_linear_projection=True,
            upcast_attention=True, sample_size=96, dual_cross_attention=False, class_embed_type=None,
            num_class_embeds=None, only_cross_attention=False)


def make_vae():
    """A tiny AutoencoderKL: 2x down, 4 latent channels (SD's)."""
    from diffusers import AutoencoderKL
    torch.manual_seed(0)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                         latent_channels=4, norm_num_groups=8)


def make_sd_folder(folder: str) -> None:
    """A diffusers pipeline folder as Stable Diffusion's is laid out: model_index.json, unet/ (random
    weights, the conv_out too, so that a load that silently kept the run's init would show), vae/,
    and text_encoder/ + tokenizer/ (a tiny CLIP)."""
    from diffusers import UNet2DConditionModel
    torch.manual_seed(3)
    UNet2DConditionModel(**UNET_KWARGS).save_pretrained(os.path.join(folder, "unet"))
    make_vae().save_pretrained(os.path.join(folder, "vae"))
    make_clip(os.path.join(folder, "text_encoder"), width=WIDTH, positions=CONTEXT)
    os.rename(os.path.join(folder, "text_encoder", "vocab.json"), os.path.join(folder, "vocab.json"))
    os.makedirs(os.path.join(folder, "tokenizer"))
    for name in os.listdir(os.path.join(folder, "text_encoder")):
        if name.startswith(("tokenizer", "special_tokens", "merges")):
            os.rename(os.path.join(folder, "text_encoder", name), os.path.join(folder, "tokenizer", name))
    os.rename(os.path.join(folder, "vocab.json"), os.path.join(folder, "tokenizer", "vocab.json"))
    json.dump({"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"],
               "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"]},
              open(os.path.join(folder, "model_index.json"), "w"))


@pytest.fixture(scope="module")
def sd_folder(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("sd") / "sd")
    make_sd_folder(folder)
    return folder


def folder_cfg(sd_folder: str, *overrides: str):
    from common.config import build_config
    from pipelines.text2image.config import T2IConfig
    return build_config(T2IConfig, os.path.join(ROOT, "pipelines/text2image/configs/tiny_unet.yaml"), [
        *sd_overrides(sd_folder), *overrides])


def sd_overrides(sd_folder: str) -> list[str]:
    """The run settings of an SD fine-tune (configs/sd15_finetune.yaml's) on the tiny folder."""
    return ["model.preset=folder", f"model.init_from={sd_folder}", "model.image_size=32", f"vae.path={sd_folder}/vae",
            f"text.hf_path={sd_folder}/text_encoder", f"text.width={WIDTH}", f"text.context_length={CONTEXT}",
            "text.hf_padding_mask=false", "diffusion.objective=ddpm", "diffusion.ddpm_schedule=scaled_linear"]


@pytest.mark.parametrize("config", [SD15, SD21], ids=["sd15", "sd21"])
def test_sd_configs_map_to_the_same_unet(config):
    """Stable Diffusion 1.x / 2.x settings give back exactly their UNet (built on the meta device:
    no memory, no weights)."""
    from diffusers import UNet2DConditionModel

    from pipelines.text2image.unet import diffusers_config_mismatch, diffusers_kwargs, unet_config_from_diffusers
    ucfg = unet_config_from_diffusers(config, img_size=64, in_channels=4, text_dim=config["cross_attention_dim"],
                                      text_len=77)
    assert not ucfg.text_mask and ucfg.patch_size == 1 and not ucfg.pooled_text
    with torch.device("meta"):
        unet = UNet2DConditionModel(**diffusers_kwargs(ucfg))
    assert diffusers_config_mismatch(unet, config) == []
    with torch.device("meta"):  # the check that guards the mapping can fail: drop one extra setting
        lost = UNet2DConditionModel(**{k: v for k, v in diffusers_kwargs(ucfg).items() if k != "upcast_attention"})
    assert diffusers_config_mismatch(lost, config) == ([] if config is SD15 else
                                                       ["upcast_attention: folder True vs built False"])


def test_folder_unet_loads_and_runs_as_diffusers_does(sd_folder):
    """model.preset=folder: the run's UNet is the folder's, weight for weight, and the run's text
    features and forward (t in [0, 1], captions with padding) equal SD's conditioning in diffusers:
    CLIP on the padded ids without a mask, t * 1000, all caption positions attended."""
    from diffusers import UNet2DConditionModel

    from pipelines.text2image import components
    from pipelines.text2image.diffusers_pipeline import init_from
    comp = components.build(folder_cfg(sd_folder))
    assert comp.model.cfg.extra == {"upcast_attention": True, "resnet_time_scale_shift": "scale_shift",
                                    "attention_head_dim": 2, "transformer_layers_per_block": 1}
    assert "unet" in init_from(comp, sd_folder)
    theirs = UNet2DConditionModel.from_pretrained(os.path.join(sd_folder, "unet")).eval()
    ours = comp.model.eval()
    for k, v in theirs.state_dict().items():
        assert torch.equal(ours.unet.state_dict()[k], v), k
    from transformers import CLIPTextModel, CLIPTokenizer
    clip = CLIPTextModel.from_pretrained(os.path.join(sd_folder, "text_encoder")).eval()
    tok = CLIPTokenizer.from_pretrained(os.path.join(sd_folder, "tokenizer"))
    captions = ["a red circle", "a blue square"]
    ids = tok(captions, padding="max_length", max_length=CONTEXT, truncation=True, return_tensors="pt").input_ids
    ctx, mask = comp.text_encoder(captions)
    assert not mask.all()  # padded positions exist, so masking them would change the output
    with torch.no_grad():
        torch.testing.assert_close(ctx, clip(ids).last_hidden_state, atol=1e-6, rtol=1e-6)
        masked_text = clip(ids, attention_mask=mask.long()).last_hidden_state
    assert (masked_text - ctx).abs().max() > 1e-4  # the mask would have changed the padding positions
    torch.manual_seed(0)
    x, t = torch.randn(2, 4, 16, 16), torch.tensor([0.25, 0.9])
    with torch.no_grad():
        got = ours(x, t, ctx, mask)
        ref = theirs(x, t * 1000, encoder_hidden_states=ctx).sample
        masked = theirs(x, t * 1000, encoder_hidden_states=ctx, encoder_attention_mask=mask).sample
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert (masked - ref).abs().max() > 1e-4
    # The bare unet/ folder (no model_index.json) is read the same way.
    bare = components.build(folder_cfg(sd_folder, f"model.init_from={sd_folder}/unet"))
    assert "UNet folder" in init_from(bare, os.path.join(sd_folder, "unet"))
    for k, v in theirs.state_dict().items():
        assert torch.equal(bare.model.unet.state_dict()[k], v), k


def test_folder_unet_refusals(sd_folder, tmp_path):
    from common.config import ConfigError
    from pipelines.text2image import components
    from pipelines.text2image.diffusers_pipeline import init_from
    from pipelines.text2image.unet import unet_config_from_diffusers
    sizes = dict(img_size=64, in_channels=4, text_dim=768, text_len=77)
    for change, named in [({"addition_embed_type": "text_time"}, "addition_embed_type='text_time'"),
                          ({"in_channels": 9}, "9 to 4 channels"),
                          ({"cross_attention_dim": 1024}, "text.width=768"),
                          ({"down_block_types": ["AttnDownBlock2D"] + SD15["down_block_types"][1:]}, "SD layout"),
                          ({"class_embed_type": "timestep"}, "class_embed_type='timestep'")]:
        with pytest.raises(ValueError, match=named.replace("(", r"\(").replace("[", r"\[")):
            unet_config_from_diffusers(dict(SD15, **change), **sizes)
    with pytest.raises(ConfigError, match="model.preset=folder takes"):
        folder_cfg(sd_folder, "model.init_from=''")
    with pytest.raises(ConfigError, match="holds no UNet2DConditionModel"):
        components.build(folder_cfg(sd_folder, f"model.init_from={tmp_path}"))
    with pytest.raises(ConfigError, match=f"cross_attention_dim is {WIDTH}, while text.width=48"):
        components.build(folder_cfg(sd_folder, "text.width=48", "text.hf_path=''"))
    # A preset run pointed at the folder: the architectures differ, and preset=folder is suggested.
    preset = components.build(folder_cfg(sd_folder, "model.preset=tiny"))
    with pytest.raises(ConfigError, match="model.preset=folder takes the folder's architecture"):
        init_from(preset, sd_folder)
    # --pipeline stable_diffusion names what a run lacks to be a StableDiffusionPipeline.
    from common.config import build_config
    from pipelines.text2image.config import T2IConfig
    from pipelines.text2image.export import build_stable_diffusion, stable_diffusion_blockers
    assert stable_diffusion_blockers(components.build(folder_cfg(sd_folder))) == []
    masked = components.build(folder_cfg(sd_folder, "text.hf_padding_mask=true"))
    assert stable_diffusion_blockers(masked) == [
        "its text encoder is not a Hugging Face one run without the padding mask (text.hf_path, "
        "text.hf_padding_mask=false)"]
    with pytest.raises(ConfigError, match="text.hf_padding_mask=false"):
        build_stable_diffusion(masked)
    dit = components.build(build_config(T2IConfig, os.path.join(ROOT, "pipelines/text2image/configs/tiny.yaml"), []))
    assert [w.split(" (")[0] for w in stable_diffusion_blockers(dit)] == [
        "its denoiser is not a UNet", "its text encoder is not a Hugging Face one run without the padding mask",
        "it has no VAE", "its objective is not DDPM"]
    # The folder's UNet learned its CLIP's features: a run on the random open_clip tower is refused.
    clipless = components.build(folder_cfg(sd_folder, "text.hf_path=''"))
    with pytest.raises(ConfigError, match=f"set text.hf_path={sd_folder}/text_encoder"):
        init_from(clipless, sd_folder)


@pytest.mark.slow
def test_fine_tune_folder_unet_exports_and_samples(sd_folder, synth_data, tmp_path):
    """Three DDPM steps on SD's betas from the folder's weights, then both exports. Ours: the
    scheduler holds the scaled_linear betas, the UNet and CLIP are run as in training, and it draws
    what sample.py draws. --pipeline stable_diffusion: diffusers' own StableDiffusionPipeline,
    loaded without the project's code, draws the same images from the same noise and timesteps."""
    from diffusers import DDPMScheduler, DiffusionPipeline, StableDiffusionPipeline

    from common.diffusion.diffusers_parts import seeded_noise
    from common.diffusion.samplers import ddim_timesteps
    from common.run import load_run
    from pipelines.text2image.spec import SPEC
    from tests.test_t2i_diffusers import CFG, PROMPTS, SEEDS, STEPS, ours
    run, out, out_sd = str(tmp_path / "run"), str(tmp_path / "export"), str(tmp_path / "export_sd")
    run_checked(train_cmd() + [
        "--config", os.path.join(ROOT, "pipelines/text2image/configs/tiny_unet.yaml"), f"run.dir={run}",
        f"data.train_shards={synth_data}/train", f"data.eval_shards={synth_data}/heldout", *sd_overrides(sd_folder),
        "train.progress=false", "data.num_workers=0", *FAST])
    proc = run_module("pipelines.text2image.export", "--run", run, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    comp, _ = load_run(SPEC, run)
    pipe = DiffusionPipeline.from_pretrained(out, trust_remote_code=True)
    assert pipe.config.unet_text_mask is False and pipe.config.text_padding_mask is False
    assert pipe.unet.config.upcast_attention
    sd = DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    torch.testing.assert_close(pipe.scheduler.alphas_cumprod, sd.alphas_cumprod, rtol=1e-5, atol=1e-6)
    assert_same_images(pipe, comp)

    proc = run_module("pipelines.text2image.export", "--run", run, "--out", out_sd, "--pipeline", "stable_diffusion")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trust_remote_code" not in proc.stdout and not os.path.exists(os.path.join(out_sd, "pipeline.py"))
    index = json.load(open(os.path.join(out_sd, "model_index.json")))
    assert index["_class_name"] == "StableDiffusionPipeline"
    sd_pipe = StableDiffusionPipeline.from_pretrained(out_sd)
    noise = seeded_noise(len(PROMPTS), (4, 16, 16), None, SEEDS[0], None, "cpu", torch.float32)
    got = sd_pipe(PROMPTS, timesteps=ddim_timesteps(1000, STEPS), guidance_scale=CFG, latents=noise,
                  output_type="pt").images
    ref, _ = ours(comp)
    diff = (got * 2 - 1 - ref).abs().max().item()
    print(f"StableDiffusionPipeline vs sample.py: max abs diff {diff:.2e} on [-1, 1]")
    assert diff < 1e-4 and ref.std() > 0.05



def test_weights_variant_names(tmp_path):
    from common.hf_folders import weights_variant
    cases = [(["diffusion_pytorch_model.fp16.safetensors"], "fp16"),
             (["diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.fp16.safetensors"], None),
             (["model.fp16.safetensors"], "fp16"), (["pytorch_model.bin"], None),
             (["diffusion_pytorch_model-00001-of-00002.fp16.safetensors",
               "diffusion_pytorch_model-00002-of-00002.fp16.safetensors",
               "diffusion_pytorch_model.safetensors.index.fp16.json"], "fp16"),
             (["model-00001-of-00002.safetensors", "model.safetensors.index.json"], None),
             (["model.fp16.safetensors", "model.ema.safetensors"], None), (["notes.fp16.safetensors"], None)]
    for i, (names, variant) in enumerate(cases):
        d = tmp_path / str(i)
        d.mkdir()
        for n in ["config.json", *names]:
            (d / n).write_text("")
        assert weights_variant(str(d)) == variant, names


def test_fp16_variant_folder_loads_in_fp32(sd_folder, tmp_path):
    """A Stable Diffusion folder that holds only fp16 weight files (unet, vae, text_encoder:
    `*.fp16.safetensors`) is read: each component in fp32, equal to the fp16 weights."""
    import shutil

    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel

    from pipelines.text2image import components
    from pipelines.text2image.diffusers_pipeline import init_from
    half = str(tmp_path / "sd_fp16")
    shutil.copytree(sd_folder, half, ignore=shutil.ignore_patterns("*.safetensors"))
    unet = UNet2DConditionModel.from_pretrained(os.path.join(sd_folder, "unet")).half()
    unet.save_pretrained(os.path.join(half, "unet"), variant="fp16")
    CLIPTextModel.from_pretrained(os.path.join(sd_folder, "text_encoder")).half().save_pretrained(
        os.path.join(half, "text_encoder"), variant="fp16")
    make_vae().half().save_pretrained(os.path.join(half, "vae"), variant="fp16")
    assert not any(f.endswith(".safetensors") and ".fp16." not in f for _, _, fs in os.walk(half) for f in fs)
    comp = components.build(folder_cfg(half, f"text.hf_path={half}/text_encoder", f"vae.path={half}/vae"))
    assert "unet" in init_from(comp, half)
    for module in (comp.model, comp.text_encoder, comp.vae):
        assert all(p.dtype == torch.float32 for p in module.parameters())
    for k, v in unet.state_dict().items():
        assert torch.equal(comp.model.unet.state_dict()[k], v.float()), k
