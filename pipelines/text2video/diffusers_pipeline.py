"""A text2video run as a diffusers pipeline: `TextToVideoPipeline` and the component diffusers has
no class for, our VideoDiT (`TextToVideoDiTModel`, a ModelMixin + ConfigMixin wrapper that saves
and loads safetensors). The open_clip text tower is common.diffusion.diffusers_parts'
OpenCLIPTextModel (shared with text2image). A pipeline folder (written by
pipelines/text2video/export.py) holds:

  model_index.json   _class_name ["pipeline", "TextToVideoPipeline"]; our components are named by
                     their module path (this module for the VideoDiT, common.diffusion.diffusers_parts
                     for the open_clip tower)
  pipeline.py        one import of this module: what DiffusionPipeline.from_pretrained(..,
                     trust_remote_code=True) runs
  transformer/       TextToVideoDiTModel (config.json + safetensors)
  text_encoder/      OpenCLIPTextModel (its BPE tokenizer is open_clip's, bundled), or a native
  tokenizer/           transformers text encoder with its tokenizer
  vae/               native AutoencoderKLWan / AutoencoderKLCogVideoX, or an AutoencoderKL applied
                     frame by frame, when the run trained on latents; the run's latent
                     normalisation (pipelines/text2video/vae.py) is in the pipeline's config
  scheduler/         FlowMatchEulerDiscreteScheduler (rectified flow, the run's shift)

__call__ reproduces common.diffusion.text_conditioned.generate as pipelines.text2video.components
.generate calls it (what sample.py draws): the same noise per seed, the same timesteps (set here,
not by the scheduler's own spacing; the shift follows the clip's token count where the run's does),
classifier-free guidance against the empty caption in one batched forward, the same decoding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.utils import BaseOutput
from diffusers.video_processor import VideoProcessor

from common.diffusion.diffusers_parts import (NUM_TRAIN_TIMESTEPS, ShimmedPipeline, WrappedDiT, encode_captions,
                                              seeded_noise, set_sampler_timesteps)
from pipelines.text2video.model import VideoDiT, VideoDiTConfig

# diffusers finds a component's load method by the base classes its module exposes by name: this
# module's ModelMixin import (above) is what makes TextToVideoDiTModel loadable.
__all__ = ["ModelMixin", "TextToVideoDiTModel", "TextToVideoPipeline", "VideoPipelineOutput"]


class TextToVideoDiTModel(WrappedDiT):
    """pipelines.text2video.model.VideoDiT as a diffusers model (common.diffusion.diffusers_parts.WrappedDiT):
    hidden_states (B, C, T, H, W)."""

    @register_to_config
    def __init__(self, dit_config: dict | None = None, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS):
        super().__init__()
        self.dit = VideoDiT(VideoDiTConfig(**(dit_config or {})))


@dataclass
class VideoPipelineOutput(BaseOutput):
    """frames: per clip a list of PIL images (pil), (B, T, H, W, 3) in [0, 1] (np),
    (B, T, 3, H, W) in [0, 1] (pt), or the sampled model-space tensor (B, C, T, H, W) (latent)."""
    frames: object


class TextToVideoPipeline(ShimmedPipeline):
    """Text -> video clips with a text2video run's VideoDiT (`transformer`), text tower, optional
    video VAE and scheduler.

    Loading: DiffusionPipeline.from_pretrained(folder, trust_remote_code=True) (runs the folder's
    one-line pipeline.py), or TextToVideoPipeline.from_pretrained(folder) (runs no code from it).
    """

    model_cpu_offload_seq = "text_encoder->transformer->vae"
    _optional_components = ["vae", "tokenizer"]

    def __init__(self, transformer: TextToVideoDiTModel, text_encoder, scheduler, vae=None, tokenizer=None,
                 text_max_length: int = 32, sample_steps: int = 20, sample_guidance: float = 3.0,
                 sample_frames: int = 8, latent_shift: list[float] | None = None,
                 latent_scale: list[float] | None = None, vae_temporal_factor: int = 1,
                 resolution_shift: list[float] | None = None, text_padding_mask: bool = True):
        super().__init__()
        self.register_modules(transformer=transformer, text_encoder=text_encoder, tokenizer=tokenizer, vae=vae,
                              scheduler=scheduler)
        # text_max_length: tokens per caption for a transformers text encoder (the run's
        # text.context_length); text_padding_mask: whether it sees the padding mask
        # (text.hf_padding_mask). sample_steps / sample_guidance / sample_frames: the defaults of
        # __call__ (the run's sample.steps, sample.cfg and model.frames, as sample.py's).
        # latent_shift / latent_scale: per channel, model-space latents = (raw - shift) * scale
        # (pipelines/text2video/vae.py); vae_temporal_factor: pixel frames per latent frame after
        # the first (causal VAEs). resolution_shift: [base_shift, base_tokens] when the run's flow
        # shift follows the token count (diffusion.shift unset), so another num_frames gets the shift
        # sample.py --frames would use; None: the scheduler's fixed shift.
        self.register_to_config(text_max_length=text_max_length, sample_steps=sample_steps,
                                sample_guidance=sample_guidance, sample_frames=sample_frames,
                                latent_shift=latent_shift, latent_scale=latent_scale,
                                vae_temporal_factor=vae_temporal_factor, resolution_shift=resolution_shift,
                                text_padding_mask=text_padding_mask)
        self.video_processor = VideoProcessor(vae_scale_factor=1, do_normalize=True)

    # ------------------------------------------------------------------ geometry
    @property
    def framewise_vae(self) -> bool:
        """An image VAE (AutoencoderKL) codes each frame alone; the video VAEs code the clip."""
        return isinstance(self.vae, AutoencoderKL)

    def latent_frames(self, frames: int) -> int:
        """Model-space frames of `frames` pixel frames (the rule of pipelines/text2video/vae.py)."""
        tf = self.config.vae_temporal_factor
        if self.vae is None or self.framewise_vae:
            return frames
        if frames < 1 or (frames - 1) % tf:
            raise ValueError(f"num_frames={frames}: a causal video VAE needs 1 + k*{tf} frames")
        latent = 1 + (frames - 1) // tf
        if type(self.vae).__name__ == "AutoencoderKLCogVideoX" and latent % 2 == 0:
            raise ValueError(f"num_frames={frames}: the CogVideoX VAE needs an odd number of latent frames "
                             f"(1 + k*{2 * tf} frames)")
        return latent

    def model_shape(self, num_frames: int | None = None) -> tuple[int, int, int, int]:
        """(channels, frames, height, width) of the VideoDiT's input for `num_frames` pixel frames
        (default: the run's clip): pixels, or VAE latents."""
        c = self.transformer.config.dit_config
        frames = c["frames"] if num_frames is None else self.latent_frames(num_frames)
        return c["in_channels"], frames, c["height"], c["width"]

    def num_tokens(self, frames: int, height: int, width: int) -> int:
        c = self.transformer.config.dit_config
        return math.ceil(frames / c["temporal_patch"]) * (height // c["patch_size"]) * (width // c["patch_size"])

    # ------------------------------------------------------------------ pieces
    def encode_prompt(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens (B, L, width), mask (B, L) bool), as the training run's text tower gives them."""
        return encode_captions(self.text_encoder, self.tokenizer, prompts, self.config.text_max_length,
                               self.config.text_padding_mask)

    def set_timesteps(self, num_inference_steps: int, num_tokens: int, device) -> None:
        """The Euler steps of common.diffusion.samplers, with the shift sample.py uses for a clip of
        `num_tokens` tokens."""
        rule = self.config.resolution_shift
        if rule is not None and isinstance(self.scheduler, FlowMatchEulerDiscreteScheduler):
            base_shift, base_tokens = rule
            self.scheduler.set_shift(math.sqrt(num_tokens / base_tokens) * base_shift)  # RectifiedFlow.shift_for
        set_sampler_timesteps(self.scheduler, num_inference_steps, device)

    def decode_latents(self, x: torch.Tensor) -> torch.Tensor:
        """Model-space latents (B, C, T', H', W') -> pixels (B, 3, T, H, W) in about [-1, 1], as
        pipelines.text2video.vae.VideoVae.decode."""
        view = (1, -1, 1, 1, 1)
        shift = torch.tensor(self.config.latent_shift, dtype=torch.float32, device=x.device).view(view)
        scale = torch.tensor(self.config.latent_scale, dtype=torch.float32, device=x.device).view(view)
        z = (x.float() / scale + shift).to(self.vae.dtype)
        if not self.framewise_vae:
            return self.vae.decode(z).sample
        b, _, t = z.shape[:3]
        frames = self.vae.decode(z.permute(0, 2, 1, 3, 4).flatten(0, 1)).sample  # time folded into the batch
        return frames.unflatten(0, (b, t)).permute(0, 2, 1, 3, 4)

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def __call__(self, prompt: str | list[str], num_inference_steps: int | None = None,
                 guidance_scale: float | None = None, num_frames: int | None = None,
                 negative_prompt: str | list[str] | None = None, generator=None, seed: int | list[int] | None = None,
                 latents: torch.Tensor | None = None, output_type: str = "np", return_dict: bool = True):
        """prompt(s) -> clips. Noise: `seed` (prompt i draws torch.Generator().manual_seed(seed + i),
        as sample.py --seed does), else `generator` (one per prompt, or one for the batch), else
        `latents`. Steps, guidance and frames default to the run's (sample_steps, sample_guidance,
        its clip length); num_frames are pixel frames, as sample.py --frames (with a causal VAE
        1 + k * its temporal factor). guidance_scale 1 runs no unconditional branch.
        output_type: np | pt | pil (frames in [0, 1], see VideoPipelineOutput) | latent."""
        num_inference_steps = num_inference_steps or self.config.sample_steps
        guidance_scale = self.config.sample_guidance if guidance_scale is None else guidance_scale
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        device = self._execution_device
        dtype = self.transformer.dtype
        guided = guidance_scale != 1.0
        ctx, mask = self.guided_context(prompts, negative_prompt, guided, device)
        shape = self.model_shape(num_frames)
        x = seeded_noise(len(prompts), shape, generator, seed, latents, device, torch.float32)
        self.set_timesteps(num_inference_steps, self.num_tokens(*shape[1:]), device)
        for t in self.progress_bar(self.scheduler.timesteps):
            x_in = torch.cat([x, x]) if guided else x
            out = self.transformer(x_in.to(dtype), t.reshape(-1).expand(x_in.shape[0]), ctx, mask,
                                   return_dict=False)[0].to(x.dtype)
            if guided:
                c, u = out.chunk(2)
                out = u + guidance_scale * (c - u)
            x = self.scheduler.step(out, t, x, return_dict=False)[0]
        if output_type == "latent":
            video = x
        else:
            pixels = self.decode_latents(x) if self.vae is not None else x
            video = self.video_processor.postprocess_video(pixels.float(), output_type=output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (video,)
        return VideoPipelineOutput(frames=video)

