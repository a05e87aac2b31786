"""Export a text2video run as a diffusers pipeline folder (safetensors, EMA weights where the
checkpoint has them).

  python -m pipelines.text2video.export --run RUN_DIR --out DIR [--checkpoint CKPT]
         [--weights ema|trained] [--overwrite]

The folder loads with the project installed (pip install -e <repo>):

  from diffusers import DiffusionPipeline
  pipe = DiffusionPipeline.from_pretrained(DIR, trust_remote_code=True)  # runs DIR/pipeline.py: one import
  # or, running no code from DIR:
  from pipelines.text2video.diffusers_pipeline import TextToVideoPipeline
  pipe = TextToVideoPipeline.from_pretrained(DIR)
  frames = pipe("a red circle moving right", seed=0).frames[0]  # (T, H, W, 3) in [0, 1]
  # steps, guidance and frames: the run's sample.steps / sample.cfg / model.frames

and draws the same clip as `python -m pipelines.text2video.sample --run RUN_DIR --prompt ...
--seed 0` with the same steps, guidance and frames (fp32). Components: transformer (our VideoDiT),
text_encoder (the open_clip tower; or the native transformers encoder and its tokenizer of
text.hf_path), vae (latent runs: the native AutoencoderKLWan / AutoencoderKLCogVideoX, or an
AutoencoderKL applied frame by frame; the run's latent normalisation is in model_index.json) and a
native FlowMatchEulerDiscreteScheduler with the run's shift (text2video trains rectified flow
only). README.md in the folder says which weights and checkpoint it holds.
"""
from __future__ import annotations

import os

from common.cli import run_cli
from common.config import ConfigError
from common.diffusion.pipeline_export import export_main
from common.nn.text_encoder import TextEncoder


def build_pipeline(comp):
    """A TextToVideoPipeline around a loaded run's components (their modules, not copies)."""
    from common.diffusion import RectifiedFlow
    from common.diffusion.diffusers_parts import OpenCLIPTextModel, scheduler_for
    from pipelines.text2video.diffusers_pipeline import TextToVideoDiTModel, TextToVideoPipeline
    from pipelines.text2video.model import VideoDiT
    if not isinstance(comp.model, VideoDiT):
        raise ConfigError(f"cannot export a {type(comp.model).__name__} as a diffusers pipeline")
    if isinstance(comp.text_encoder, TextEncoder):
        text = dict(text_encoder=OpenCLIPTextModel.from_encoder(comp.text_encoder))
    else:  # common.nn.text_encoder.HFTextEncoder: native transformers model and tokenizer
        text = dict(text_encoder=comp.text_encoder.model, tokenizer=comp.text_encoder.tokenizer,
                    text_padding_mask=comp.text_encoder.padding_mask)
    latent = {}
    if comp.vae is not None:  # pipelines/text2video/vae.py's VideoVae: the diffusers VAE and its normalisation
        latent = dict(vae=comp.vae.vae, latent_shift=[float(v) for v in comp.vae.shift.flatten()],
                      latent_scale=[float(v) for v in comp.vae.scale.flatten()],
                      vae_temporal_factor=comp.vae.temporal_factor)
    flow = comp.objective
    resolution_shift = ([float(flow.base_shift), float(flow.base_tokens)]
                        if isinstance(flow, RectifiedFlow) and flow.shift is None else None)
    return TextToVideoPipeline(transformer=TextToVideoDiTModel.from_dit(comp.model),
                               scheduler=scheduler_for(comp.objective, comp.num_tokens),
                               text_max_length=comp.cfg.text.context_length, sample_steps=comp.cfg.sample.steps,
                               sample_guidance=comp.cfg.sample.cfg, sample_frames=comp.pixel_clip_shape[0],
                               resolution_shift=resolution_shift, **text, **latent)


def _describe_scheduler(comp, pipe) -> str:
    shift = comp.objective.shift_for(comp.num_tokens)
    rule = "" if pipe.config.resolution_shift is None else " at the run's clip; it follows the token count"
    return f"{type(pipe.scheduler).__name__} (rectified flow, shift {shift:g}{rule})"


def _describe_vae(pipe) -> str:
    if pipe.vae is None:
        return "none (pixel space)"
    how = "frame by frame" if pipe.framewise_vae else f"causal, {pipe.config.vae_temporal_factor}x time"
    return f"{type(pipe.vae).__name__} ({how}); latents normalised per channel as the run did"


def _model_card(comp, meta: dict, ckpt: str, weights: str, pipe, run: str) -> str:
    cfg = comp.cfg
    frames, height, width = comp.pixel_clip_shape
    parts = [f"- denoiser: transformer: our VideoDiT ({sum(p.numel() for p in pipe.transformer.parameters()) / 1e6:.2f}M "
             f"parameters, {comp.model.cfg.attention} attention), input {'x'.join(map(str, pipe.model_shape()))}",
             f"- text encoder: {type(pipe.text_encoder).__name__}, {cfg.text.context_length} tokens per caption",
             f"- VAE: {_describe_vae(pipe)}",
             f"- scheduler: {_describe_scheduler(comp, pipe)}"]
    return f"""---
library_name: diffusers
tags: [text-to-video]
---
# text2video pipeline{f' ({cfg.run.name})' if cfg.run.name else ''}

Exported from the run `{os.path.abspath(run)}`, checkpoint `{os.path.basename(ckpt)}` (step {meta['step']}).
Weights: **{weights}**. Clips of {frames} frames, {height}x{width} px; the run's sampling defaults:
{cfg.sample.steps} steps, guidance {cfg.sample.cfg:g}. `training_config.yaml` is the run's resolved config.

{chr(10).join(parts)}

Needs the project installed (`pip install -e <repo>`): the transformer and the open_clip text tower
are the project's classes (`pipelines.text2video.diffusers_pipeline`, `common.diffusion.diffusers_parts`).

```python
from diffusers import DiffusionPipeline
pipe = DiffusionPipeline.from_pretrained(FOLDER, trust_remote_code=True)  # pipeline.py: one import line
# or, running no code from the folder:
# from pipelines.text2video.diffusers_pipeline import TextToVideoPipeline
# pipe = TextToVideoPipeline.from_pretrained(FOLDER)
frames = pipe("a red circle", num_inference_steps={cfg.sample.steps}, guidance_scale={cfg.sample.cfg:g}, seed=0).frames[0]
```
`seed=K` draws what `python -m pipelines.text2video.sample --seed K` draws for the same prompt
(prompt i of a list gets seed K + i); `num_frames=` is sample.py's `--frames`; `generator=` and
`latents=` work as in other pipelines. Frames come as (T, H, W, 3) floats in [0, 1]
(`output_type="np"`), PIL images (`"pil"`) or a (T, 3, H, W) tensor (`"pt"`).
"""


def _summary(comp, pipe) -> str:
    parts = ["transformer", "text_encoder"] + (["tokenizer"] if pipe.tokenizer is not None else [])
    parts += [f"vae ({type(pipe.vae).__name__})"] if pipe.vae is not None else []
    return f"{', '.join(parts)}, scheduler {_describe_scheduler(comp, pipe)}"


def _spec():
    from pipelines.text2video.spec import SPEC
    return SPEC


def main(argv=None) -> int:
    return export_main(argv, prog="python -m pipelines.text2video.export", doc=__doc__, load_spec=_spec,
                       build_pipeline=build_pipeline, model_card=_model_card, summary=_summary)


if __name__ == "__main__":
    run_cli(main)
