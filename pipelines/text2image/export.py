"""Export a text2image run as a diffusers pipeline folder (safetensors, EMA weights where the
checkpoint has them).

  python -m pipelines.text2image.export --run RUN_DIR --out DIR [--checkpoint CKPT]
         [--weights ema|trained] [--overwrite] [--pipeline project|stable_diffusion|pixart|sd3]

The folder loads with the project installed (pip install -e <repo>):

  from diffusers import DiffusionPipeline
  pipe = DiffusionPipeline.from_pretrained(DIR, trust_remote_code=True)  # runs DIR/pipeline.py: one import
  # or, running no code from DIR:
  from pipelines.text2image.diffusers_pipeline import TextToImagePipeline
  pipe = TextToImagePipeline.from_pretrained(DIR)
  image = pipe("a red circle", seed=0).images[0]  # steps and guidance: the run's sample.steps / sample.cfg

and draws the same image as `python -m pipelines.text2image.sample --run RUN_DIR --prompt ...
--seed 0` with the same steps and guidance (fp32). Components: transformer (our DiT; or unet, a
native UNet2DConditionModel), text_encoder (the open_clip tower; or the native transformers
encoder and its tokenizer of text.hf_path), vae (native AutoencoderKL, latent runs) and a native
scheduler (FlowMatchEulerDiscreteScheduler with the run's shift, or DPMSolverMultistepScheduler of
order 1 = DDIM for DDPM runs). README.md in the folder says which weights and checkpoint it holds.

--pipeline stable_diffusion writes diffusers' own StableDiffusionPipeline instead (no project code
needed to load it), for a run conditioned as Stable Diffusion is (an SD UNet fine-tuned with
configs/sd15_finetune.yaml): `StableDiffusionPipeline.from_pretrained(DIR)`. --pipeline pixart
writes diffusers' own PixArtAlphaPipeline for a model.arch=pixart DDPM run (a PixArt-alpha / Sigma
fine-tune): `PixArtAlphaPipeline.from_pretrained(DIR)`; PixArt runs export only this way.
--pipeline sd3 writes diffusers' own StableDiffusion3Pipeline for a model.arch=sd3 run on SD3's
text stack (text.hf_path = an SD3 pipeline folder) with a VAE, trained with rectified flow:
`StableDiffusion3Pipeline.from_pretrained(DIR)`; SD3 runs export only this way.
"""
from __future__ import annotations

import os

import numpy as np

from common.cli import run_cli
from common.config import ConfigError
from common.diffusion import RectifiedFlow
from common.diffusion.pipeline_export import export_main
from common.diffusion.samplers import ddim_timesteps
from common.nn.text_encoder import TextEncoder


PIPELINES = ("project", "stable_diffusion", "pixart", "sd3")


def add_options(p) -> list[str]:
    p.add_argument("--pipeline", choices=PIPELINES, default="project",
                   help="project (default): TextToImagePipeline, any DiT or UNet run; loads with the project installed. "
                        "stable_diffusion: diffusers' own StableDiffusionPipeline (loads without the project), for a "
                        "run on a UNet with Stable Diffusion's conditioning (model.preset=folder from an SD folder, "
                        "text.hf_padding_mask=false, a VAE, DDPM); it samples with the scheduler's own timestep "
                        "spacing unless given timesteps=. pixart: diffusers' own PixArtAlphaPipeline (loads "
                        "without the project), for a model.arch=pixart run with a VAE and a Hugging Face text "
                        "encoder run with its padding mask (e.g. PixArt's T5), trained with DDPM. sd3: diffusers' "
                        "own StableDiffusion3Pipeline (loads without the project), for a model.arch=sd3 run on SD3's "
                        "three text encoders (text.hf_path = an SD3 pipeline folder) with a VAE, trained with "
                        "rectified flow")
    return ["pipeline"]


def stable_diffusion_blockers(comp) -> list[str]:
    """Why a run cannot be a StableDiffusionPipeline (empty: it can): that pipeline feeds its UNet
    the unmasked CLIP features of the padded caption, t in DDPM steps, and VAE latents."""
    from common.diffusion import DDPM
    from common.nn.text_encoder import HFTextEncoder
    c = getattr(comp.model, "cfg", None)
    why = []
    if not hasattr(comp.model, "unet"):
        why.append("its denoiser is not a UNet (model.arch=unet)")
    elif c.pooled_text or c.patch_size != 1 or c.text_mask:
        why.append("its UNet is not conditioned as SD's (no pooled text, no space-to-depth, all caption positions "
                   "attended: model.preset=folder from an SD folder)")
    if not isinstance(comp.text_encoder, HFTextEncoder) or comp.text_encoder.padding_mask:
        why.append("its text encoder is not a Hugging Face one run without the padding mask (text.hf_path, "
                   "text.hf_padding_mask=false)")
    if comp.vae is None:
        why.append("it has no VAE (vae.path)")
    if not isinstance(comp.objective, DDPM):
        why.append("its objective is not DDPM (diffusion.objective=ddpm)")
    return why


def pixart_blockers(comp) -> list[str]:
    """Why a run cannot be a PixArtAlphaPipeline (empty: it can): that pipeline feeds its transformer
    the text encoder's features of the padded caption computed with its padding mask, t in the
    scheduler's steps, VAE latents, and resolution conditions exactly when sample_size is 128."""
    from common.diffusion import DDPM
    from common.nn.text_encoder import HFTextEncoder
    from pipelines.text2image.pixart import PixArt
    why = []
    if not isinstance(comp.model, PixArt):
        why.append("its denoiser is not a PixArt transformer (model.arch=pixart)")
    elif comp.model.transformer.use_additional_conditions != (comp.model.transformer.config.sample_size == 128):
        why.append("its transformer's resolution conditions (use_additional_conditions) are not what the pipeline "
                   "gives (exactly when sample_size is 128)")
    if not isinstance(comp.text_encoder, HFTextEncoder) or not comp.text_encoder.padding_mask:
        why.append("its text encoder is not a Hugging Face one run with the padding mask (text.hf_path, "
                   "text.hf_padding_mask=true)")
    if comp.vae is None:
        why.append("it has no VAE (vae.path)")
    if not isinstance(comp.objective, DDPM):
        # The pipeline scales its initial noise by scheduler.init_noise_sigma, which flow-matching
        # schedulers do not have.
        why.append("its objective is not DDPM (diffusion.objective=ddpm; PixArtAlphaPipeline's loop needs a DDPM "
                   "scheduler)")
    return why


def build_pixart(comp):
    from diffusers import PixArtAlphaPipeline

    from common.diffusion.diffusers_parts import scheduler_for
    why = pixart_blockers(comp)
    if why:
        raise ConfigError(f"--pipeline pixart: this run cannot be one: {'; '.join(why)}")
    return PixArtAlphaPipeline(tokenizer=comp.text_encoder.tokenizer, text_encoder=comp.text_encoder.model,
                               vae=run_vae(comp), transformer=comp.model.transformer,
                               scheduler=scheduler_for(comp.objective, comp.num_tokens))


def sd3_blockers(comp) -> list[str]:
    """Why a run cannot be a StableDiffusion3Pipeline (empty: it can): that pipeline feeds its
    transformer SD3's three encoders' features (CLIP-L, CLIP-G and T5 tokens, the pooled CLIP
    vector), sigma x 1000 as the timestep, and VAE latents shifted and scaled."""
    from common.nn.text_encoder import SD3TextEncoders
    from pipelines.text2image.sd3 import SD3
    why = []
    if not isinstance(comp.model, SD3):
        why.append("its denoiser is not an SD3 transformer (model.arch=sd3)")
    if not isinstance(comp.text_encoder, SD3TextEncoders):
        why.append("its text encoder is not SD3's three (text.hf_path = an SD3 pipeline folder)")
    if comp.vae is None:
        why.append("it has no VAE (vae.path)")
    if not isinstance(comp.objective, RectifiedFlow):
        why.append("its objective is not rectified flow (diffusion.objective=flow)")
    return why


def build_sd3(comp):
    from diffusers import StableDiffusion3Pipeline

    from common.diffusion.diffusers_parts import scheduler_for
    why = sd3_blockers(comp)
    if why:
        raise ConfigError(f"--pipeline sd3: this run cannot be one: {'; '.join(why)}")
    enc = comp.text_encoder
    return StableDiffusion3Pipeline(transformer=comp.model.transformer, vae=run_vae(comp),
                                    scheduler=scheduler_for(comp.objective, comp.num_tokens),
                                    text_encoder=enc.clip_l, tokenizer=enc.tok_l, text_encoder_2=enc.clip_g,
                                    tokenizer_2=enc.tok_g, text_encoder_3=enc.t5, tokenizer_3=enc.tok_t5)


def run_vae(comp):
    """The run's VAE (or None) carrying the run's vae.scaling_factor override, where diffusers reads it."""
    if comp.vae is not None and comp.cfg.vae.scaling_factor:
        comp.vae.register_to_config(scaling_factor=comp.latent_scale)
    return comp.vae


def build_stable_diffusion(comp):
    from diffusers import StableDiffusionPipeline

    from common.diffusion.diffusers_parts import scheduler_for
    why = stable_diffusion_blockers(comp)
    if why:
        raise ConfigError(f"--pipeline stable_diffusion: this run cannot be one: {'; '.join(why)}")
    vae = run_vae(comp)
    # StableDiffusionPipeline pads captions to the tokenizer's model_max_length: the run's length.
    tokenizer = comp.text_encoder.tokenizer
    tokenizer.model_max_length = comp.cfg.text.context_length
    return StableDiffusionPipeline(vae=vae, text_encoder=comp.text_encoder.model, tokenizer=tokenizer,
                                   unet=comp.model.unet, scheduler=scheduler_for(comp.objective, comp.num_tokens),
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def build_pipeline(comp, pipeline: str = "project"):
    """A TextToImagePipeline (or with pipeline="stable_diffusion" diffusers' StableDiffusionPipeline)
    around a loaded run's components (their modules, not copies)."""
    if pipeline == "stable_diffusion":
        return build_stable_diffusion(comp)
    if pipeline == "pixart":
        return build_pixart(comp)
    if pipeline == "sd3":
        return build_sd3(comp)
    from pipelines.text2image.diffusers_pipeline import (OpenCLIPTextModel, TextToImageDiTModel,
                                                         TextToImagePipeline, scheduler_for)
    from pipelines.text2image.model import DiT
    from pipelines.text2image.sd3 import SD3
    denoiser = {}
    if isinstance(comp.model, DiT):
        denoiser["transformer"] = TextToImageDiTModel.from_dit(comp.model)
    elif hasattr(comp.model, "unet"):  # pipelines/text2image/unet.py: a native UNet2DConditionModel inside
        denoiser.update(unet=comp.model.unet, unet_pooled_text=bool(comp.model.cfg.pooled_text),
                        unet_patch_size=int(getattr(comp.model.cfg, "patch_size", 1)),
                        unet_text_mask=bool(getattr(comp.model.cfg, "text_mask", True)))
    elif isinstance(comp.model, SD3):
        raise ConfigError("a model.arch=sd3 run exports as diffusers' own StableDiffusion3Pipeline: --pipeline sd3 "
                          "(on SD3's own text encoders, text.hf_path = an SD3 pipeline folder)")
    elif hasattr(comp.model, "transformer"):  # pipelines/text2image/pixart.py
        raise ConfigError("a model.arch=pixart run exports as diffusers' own PixArtAlphaPipeline: --pipeline pixart")
    else:
        raise ConfigError(f"cannot export a {type(comp.model).__name__} as a diffusers pipeline")
    if isinstance(comp.text_encoder, TextEncoder):
        text = dict(text_encoder=OpenCLIPTextModel.from_encoder(comp.text_encoder))
    else:  # common.nn.text_encoder.HFTextEncoder: native transformers model and tokenizer
        text = dict(text_encoder=comp.text_encoder.model, tokenizer=comp.text_encoder.tokenizer,
                    text_padding_mask=comp.text_encoder.padding_mask)
    vae = run_vae(comp)
    return TextToImagePipeline(scheduler=scheduler_for(comp.objective, comp.num_tokens), vae=vae,
                               text_max_length=comp.cfg.text.context_length, sample_steps=comp.cfg.sample.steps,
                               sample_guidance=comp.cfg.sample.cfg, **denoiser, **text)


def _describe_scheduler(comp, pipe) -> str:
    name = type(pipe.scheduler).__name__
    if isinstance(comp.objective, RectifiedFlow):
        return f"{name} (rectified flow, shift {comp.objective.shift_for(comp.num_tokens):g})"
    return f"{name} (DDPM {comp.objective.prediction}-prediction, order 1 = deterministic DDIM)"


def _is_stable_diffusion(pipe) -> bool:
    return type(pipe).__name__ == "StableDiffusionPipeline"


def _is_pixart(pipe) -> bool:
    return type(pipe).__name__ == "PixArtAlphaPipeline"


def _is_sd3(pipe) -> bool:
    return type(pipe).__name__ == "StableDiffusion3Pipeline"


def _sd3_model_card(comp, meta: dict, ckpt: str, weights: str, pipe, run: str) -> str:
    cfg = comp.cfg
    sigmas = ", ".join(f"{s:g}" for s in np.linspace(1.0, 0.0, cfg.sample.steps + 1)[:-1])
    return f"""---
library_name: diffusers
tags: [text-to-image, stable-diffusion-3]
---
# Stable Diffusion 3 pipeline{f' ({cfg.run.name})' if cfg.run.name else ''}

Fine-tuned in the run `{os.path.abspath(run)}`, checkpoint `{os.path.basename(ckpt)}` (step {meta['step']}).
Weights: **{weights}**. Resolution {cfg.model.image_size} px. A plain diffusers StableDiffusion3Pipeline:
SD3Transformer2DModel ({sum(p.numel() for p in pipe.transformer.parameters()) / 1e6:.1f}M parameters), the
frozen CLIP-L, CLIP-G and T5 encoders it was trained on, AutoencoderKL, and {_describe_scheduler(comp, pipe)}.
`training_config.yaml` is the run's resolved config.

```python
from diffusers import StableDiffusion3Pipeline
pipe = StableDiffusion3Pipeline.from_pretrained(FOLDER)
image = pipe("a red circle", num_inference_steps={cfg.sample.steps}, guidance_scale={cfg.sample.cfg:g},
             max_sequence_length={cfg.text.context_length}, height={cfg.model.image_size}, width={cfg.model.image_size}).images[0]
```
The run's captions were {cfg.text.context_length} T5 tokens: pass `max_sequence_length` as above. The
training run's own sampler (`python -m pipelines.text2image.sample`) steps through the unshifted
sigmas [{sigmas}] (the scheduler shifts them); pass them as `sigmas=[...]` (and its noise as
`latents=`) to draw the same image.
"""


def _pixart_model_card(comp, meta: dict, ckpt: str, weights: str, pipe, run: str) -> str:
    cfg = comp.cfg
    timesteps = f"timesteps=[{', '.join(map(str, ddim_timesteps(comp.objective.num_timesteps, cfg.sample.steps)))}]"
    binning = pipe.transformer.config.sample_size in (32, 64, 128)
    return f"""---
library_name: diffusers
tags: [text-to-image, pixart]
---
# PixArt pipeline{f' ({cfg.run.name})' if cfg.run.name else ''}

Trained in the run `{os.path.abspath(run)}`, checkpoint `{os.path.basename(ckpt)}` (step {meta['step']}).
Weights: **{weights}**. Resolution {cfg.model.image_size} px. A plain diffusers PixArtAlphaPipeline:
PixArtTransformer2DModel ({sum(p.numel() for p in pipe.transformer.parameters()) / 1e6:.1f}M parameters),
{type(pipe.text_encoder).__name__}, AutoencoderKL, and {_describe_scheduler(comp, pipe)}.
`training_config.yaml` is the run's resolved config.

```python
from diffusers import PixArtAlphaPipeline
pipe = PixArtAlphaPipeline.from_pretrained(FOLDER)
image = pipe("a red circle", num_inference_steps={cfg.sample.steps}, guidance_scale={cfg.sample.cfg:g},
             max_sequence_length={cfg.text.context_length}, clean_caption=False,
             height={cfg.model.image_size}, width={cfg.model.image_size}{'' if binning else ', use_resolution_binning=False'}).images[0]
```
The run's captions were {cfg.text.context_length} tokens, uncleaned: pass `max_sequence_length` and
`clean_caption=False` as above. The training run's own sampler (`python -m pipelines.text2image.sample`)
takes {timesteps} for {cfg.sample.steps} steps; pass them (and its noise as `latents=`) to draw the same image.
"""


def _sd_model_card(comp, meta: dict, ckpt: str, weights: str, pipe, run: str) -> str:
    cfg = comp.cfg
    steps = ", ".join(map(str, ddim_timesteps(comp.objective.num_timesteps, cfg.sample.steps)))
    return f"""---
library_name: diffusers
tags: [text-to-image, stable-diffusion]
---
# Stable Diffusion pipeline{f' ({cfg.run.name})' if cfg.run.name else ''}

Fine-tuned in the run `{os.path.abspath(run)}`, checkpoint `{os.path.basename(ckpt)}` (step {meta['step']}).
Weights: **{weights}**. Resolution {cfg.model.image_size} px. A plain diffusers StableDiffusionPipeline (no
safety checker): UNet2DConditionModel ({sum(p.numel() for p in pipe.unet.parameters()) / 1e6:.1f}M parameters),
{type(pipe.text_encoder).__name__}, AutoencoderKL, and {_describe_scheduler(comp, pipe)}.
`training_config.yaml` is the run's resolved config.

```python
from diffusers import StableDiffusionPipeline
pipe = StableDiffusionPipeline.from_pretrained(FOLDER)
image = pipe("a red circle", num_inference_steps={cfg.sample.steps}, guidance_scale={cfg.sample.cfg:g}).images[0]
```
The training run's own sampler (`python -m pipelines.text2image.sample`) takes the timesteps
[{steps}] for {cfg.sample.steps} steps; pass them as `timesteps=[...]` (and its noise as `latents=`) to draw
the same image.
"""


def _model_card(comp, meta: dict, ckpt: str, weights: str, pipe, run: str) -> str:
    if _is_stable_diffusion(pipe):
        return _sd_model_card(comp, meta, ckpt, weights, pipe, run)
    if _is_pixart(pipe):
        return _pixart_model_card(comp, meta, ckpt, weights, pipe, run)
    if _is_sd3(pipe):
        return _sd3_model_card(comp, meta, ckpt, weights, pipe, run)
    cfg = comp.cfg
    parts = [f"- denoiser: {'transformer: our DiT' if pipe.transformer is not None else 'unet: UNet2DConditionModel'} "
             f"({sum(p.numel() for p in pipe.denoiser.parameters()) / 1e6:.2f}M parameters), "
             f"input {'x'.join(map(str, pipe.model_shape))}",
             f"- text encoder: {type(pipe.text_encoder).__name__}, {cfg.text.context_length} tokens per caption",
             f"- VAE: {'AutoencoderKL, scaling factor %g' % pipe.vae.config.scaling_factor if pipe.vae is not None else 'none (pixel space)'}",
             f"- scheduler: {_describe_scheduler(comp, pipe)}"]
    return f"""---
library_name: diffusers
tags: [text-to-image]
---
# text2image pipeline{f' ({cfg.run.name})' if cfg.run.name else ''}

Exported from the run `{os.path.abspath(run)}`, checkpoint `{os.path.basename(ckpt)}` (step {meta['step']}).
Weights: **{weights}**. Resolution {cfg.model.image_size} px; the run's sampling defaults: {cfg.sample.steps} steps,
guidance {cfg.sample.cfg:g}. `training_config.yaml` is the run's resolved config.

{chr(10).join(parts)}

Needs the project installed (`pip install -e <repo>`): the transformer and the open_clip text tower
are the project's classes (`pipelines.text2image.diffusers_pipeline`, `common.diffusion.diffusers_parts`).

```python
from diffusers import DiffusionPipeline
pipe = DiffusionPipeline.from_pretrained(FOLDER, trust_remote_code=True)  # pipeline.py: one import line
# or, running no code from the folder:
# from pipelines.text2image.diffusers_pipeline import TextToImagePipeline
# pipe = TextToImagePipeline.from_pretrained(FOLDER)
image = pipe("a red circle", num_inference_steps={cfg.sample.steps}, guidance_scale={cfg.sample.cfg:g}, seed=0).images[0]
```
`seed=K` draws what `python -m pipelines.text2image.sample --seed K` draws for the same prompt
(prompt i of a list gets seed K + i); `generator=` and `latents=` work as in other pipelines.
"""


def _summary(comp, pipe) -> str:
    if _is_stable_diffusion(pipe):
        return f"StableDiffusionPipeline (unet, text_encoder, tokenizer, vae), scheduler {_describe_scheduler(comp, pipe)}"
    if _is_pixart(pipe):
        return f"PixArtAlphaPipeline (transformer, text_encoder, tokenizer, vae), scheduler {_describe_scheduler(comp, pipe)}"
    if _is_sd3(pipe):
        return (f"StableDiffusion3Pipeline (transformer, text_encoder x3, tokenizer x3, vae), scheduler "
                f"{_describe_scheduler(comp, pipe)}")
    parts = ["transformer" if pipe.transformer is not None else "unet", "text_encoder"]
    parts += ["tokenizer"] if pipe.tokenizer is not None else []
    parts += ["vae"] if pipe.vae is not None else []
    return f"{', '.join(parts)}, scheduler {_describe_scheduler(comp, pipe)}"


def _spec():
    from pipelines.text2image.spec import SPEC
    return SPEC


def main(argv=None) -> int:
    return export_main(argv, prog="python -m pipelines.text2image.export", doc=__doc__, load_spec=_spec,
                       build_pipeline=build_pipeline, model_card=_model_card, summary=_summary,
                       add_options=add_options)


if __name__ == "__main__":
    run_cli(main)
