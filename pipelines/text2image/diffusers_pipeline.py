"""A text2image run as a diffusers pipeline: `TextToImagePipeline` and the two components diffusers
has no class for, our DiT (`TextToImageDiTModel`) and the open_clip text tower (`OpenCLIPTextModel`),
as ModelMixin + ConfigMixin wrappers that save and load safetensors with `save_pretrained` /
`from_pretrained`. A pipeline folder (written by pipelines/text2image/export.py) holds:

  model_index.json   _class_name ["pipeline", "TextToImagePipeline"]; our components are named by
                     their module path (pipelines.text2image.diffusers_pipeline for the DiT;
                     common.diffusion.diffusers_parts for the text tower, shared with text2video;
                     folders written before it moved there name this module, which re-exports it)
  pipeline.py        one import of this module: what DiffusionPipeline.from_pretrained(..,
                     trust_remote_code=True) runs (diffusers 0.42 imports no library a folder names)
  transformer/       TextToImageDiTModel (config.json + safetensors), or unet/: a native UNet2DConditionModel
  text_encoder/      OpenCLIPTextModel (its BPE tokenizer is open_clip's, bundled), or a native
  tokenizer/           transformers CLIPTextModel / T5EncoderModel with its tokenizer
  vae/               native AutoencoderKL, when the run trained on latents
  scheduler/         FlowMatchEulerDiscreteScheduler (rectified flow, the run's shift) or
                     DPMSolverMultistepScheduler of order 1 (DDPM: deterministic DDIM, the run's betas)

__call__ reproduces common.diffusion.text_conditioned.generate (what sample.py draws): the same
noise per seed, the same timesteps (set here, not by the schedulers' own spacing), classifier-free
guidance against the empty caption in one batched forward, the same decoding.
"""
from __future__ import annotations

import dataclasses
import json
import os

import torch
from diffusers import AutoencoderKL, ModelMixin, UNet2DConditionModel
from diffusers.configuration_utils import register_to_config
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput

# The shared parts live in common/diffusion (text2video uses them too); they are re-exported here
# because folders exported before the move name this module as their text_encoder's library.
from common.diffusion import diffusers_parts
from common.diffusion.diffusers_parts import (NUM_TRAIN_TIMESTEPS, SHIM, OpenCLIPTextModel, ShimmedPipeline,
                                              WrappedDiT, encode_captions, scheduler_for, seeded_noise,
                                              set_sampler_timesteps)
from common.diffusion.pipeline_export import checkpoint_has_ema
from common.hf_folders import weights_variant
from common.nn.text_encoder import TextEncoder
from pipelines.text2image.model import DiT, DiTConfig
from pipelines.text2image import pixart, sd3
from pipelines.text2image.components import pixart_folder, sd3_folder, unet_folder
from pipelines.text2image.unet import diffusers_config_mismatch, run_unet

# diffusers finds a component's load method by the base classes its module exposes by name: this
# module's ModelMixin import (above) is what makes its wrappers loadable.
__all__ = ["ModelMixin", "TextToImageDiTModel", "OpenCLIPTextModel", "TextToImagePipeline", "scheduler_for",
           "write_loader_shim", "checkpoint_has_ema", "init_from", "NUM_TRAIN_TIMESTEPS", "SHIM"]


def write_loader_shim(folder: str, class_name: str = "TextToImagePipeline") -> None:
    """The loader shim naming `class_name` of this module (diffusers_parts.write_loader_shim)."""
    diffusers_parts.write_loader_shim(folder, __name__, class_name)


class TextToImageDiTModel(WrappedDiT):
    """pipelines.text2image.model.DiT as a diffusers model (common.diffusion.diffusers_parts.WrappedDiT)."""

    @register_to_config
    def __init__(self, dit_config: dict | None = None, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS):
        super().__init__()
        self.dit = DiT(DiTConfig(**(dit_config or {})))


class TextToImagePipeline(ShimmedPipeline):
    """Text -> image with a text2image run's denoiser (`transformer`: our DiT, or `unet`: a native
    UNet2DConditionModel), text tower, optional VAE and scheduler.

    Loading: DiffusionPipeline.from_pretrained(folder, trust_remote_code=True) (runs the folder's
    one-line pipeline.py), or TextToImagePipeline.from_pretrained(folder) (runs no code from it).
    """

    model_cpu_offload_seq = "text_encoder->transformer->unet->vae"
    _optional_components = ["transformer", "unet", "vae", "tokenizer"]

    def __init__(self, text_encoder, scheduler, transformer: TextToImageDiTModel | None = None,
                 unet: UNet2DConditionModel | None = None, vae: AutoencoderKL | None = None, tokenizer=None,
                 text_max_length: int = 32, unet_pooled_text: bool = False, unet_patch_size: int = 1,
                 unet_text_mask: bool = True, text_padding_mask: bool = True, sample_steps: int = 30,
                 sample_guidance: float = 3.0):
        super().__init__()
        if (transformer is None) == (unet is None):
            raise ValueError("TextToImagePipeline needs exactly one denoiser: transformer or unet")
        self.register_modules(transformer=transformer, unet=unet, text_encoder=text_encoder, tokenizer=tokenizer,
                              vae=vae, scheduler=scheduler)
        # text_max_length: tokens per caption for a transformers text encoder (the run's
        # text.context_length); text_padding_mask: whether it sees the padding mask
        # (text.hf_padding_mask). The UNet as pipelines/text2image/unet.py runs it: the masked mean
        # of the text tokens as class_labels (unet_pooled_text), inputs space-to-depth by
        # unet_patch_size (pixel_unshuffle before, pixel_shuffle after), padded caption tokens masked
        # out of cross-attention unless unet_text_mask is False (Stable Diffusion's own UNets).
        # sample_steps / sample_guidance: the defaults of __call__ (the run's sample.steps / sample.cfg,
        # as sample.py's).
        self.register_to_config(text_max_length=text_max_length, unet_pooled_text=unet_pooled_text,
                                unet_patch_size=unet_patch_size, unet_text_mask=unet_text_mask,
                                text_padding_mask=text_padding_mask, sample_steps=sample_steps,
                                sample_guidance=sample_guidance)
        factor = 2 ** (len(vae.config.block_out_channels) - 1) if vae is not None else 1
        self.image_processor = VaeImageProcessor(vae_scale_factor=factor, do_normalize=True)

    # ------------------------------------------------------------------ pieces
    @property
    def denoiser(self):
        return self.transformer if self.transformer is not None else self.unet

    @property
    def model_shape(self) -> tuple[int, int, int]:
        """(channels, height, width) of the denoiser's input: pixels, or VAE latents."""
        if self.transformer is not None:
            c = self.transformer.config.dit_config
            return c["in_channels"], c["img_size"], c["img_size"]
        p = self.config.unet_patch_size
        size = self.unet.config.sample_size * p
        return self.unet.config.in_channels // (p * p), size, size

    def encode_prompt(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens (B, L, width), mask (B, L) bool), as the training run's text tower gives them."""
        return encode_captions(self.text_encoder, self.tokenizer, prompts, self.config.text_max_length,
                               self.config.text_padding_mask)

    def set_timesteps(self, num_inference_steps: int, device) -> None:
        """The steps of common.diffusion.samplers (diffusers_parts.set_sampler_timesteps)."""
        set_sampler_timesteps(self.scheduler, num_inference_steps, device)

    def predict(self, x: torch.Tensor, t: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        t = t.reshape(-1).expand(x.shape[0])
        if self.transformer is not None:
            return self.transformer(x, t, ctx, mask, return_dict=False)[0]
        return run_unet(self.unet, x, t.float(), ctx, mask, pooled_text=self.config.unet_pooled_text,
                        patch_size=self.config.unet_patch_size, text_mask=self.config.unet_text_mask)

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def __call__(self, prompt: str | list[str], num_inference_steps: int | None = None,
                 guidance_scale: float | None = None,
                 negative_prompt: str | list[str] | None = None, generator=None, seed: int | list[int] | None = None,
                 latents: torch.Tensor | None = None, output_type: str = "pil", return_dict: bool = True):
        """prompt(s) -> images. Noise: `seed` (prompt i draws torch.Generator().manual_seed(seed + i),
        as sample.py --seed does), else `generator` (one per prompt, or one for the batch), else
        `latents`. Steps and guidance default to the run's (sample_steps, sample_guidance);
        guidance_scale 1 runs no unconditional branch. output_type: pil | np | pt (images in
        [0, 1]) | latent (the sampled model-space tensor, before the VAE)."""
        num_inference_steps = num_inference_steps or self.config.sample_steps
        guidance_scale = self.config.sample_guidance if guidance_scale is None else guidance_scale
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        device = self._execution_device
        dtype = self.denoiser.dtype
        guided = guidance_scale != 1.0
        ctx, mask = self.guided_context(prompts, negative_prompt, guided, device)
        x = seeded_noise(len(prompts), self.model_shape, generator, seed, latents, device, torch.float32)
        self.set_timesteps(num_inference_steps, device)
        for t in self.progress_bar(self.scheduler.timesteps):
            x_in = torch.cat([x, x]) if guided else x
            out = self.predict(x_in.to(dtype), t, ctx, mask).to(x.dtype)
            if guided:
                c, u = out.chunk(2)
                out = u + guidance_scale * (c - u)
            x = self.scheduler.step(out, t, x, return_dict=False)[0]
        if output_type == "latent":
            image = x
        else:
            if self.vae is not None:
                shift = getattr(self.vae.config, "shift_factor", None) or 0.0  # SD3-style VAEs
                x = self.vae.decode(x.to(self.vae.dtype) / self.vae.config.scaling_factor + shift).sample
            image = self.image_processor.postprocess(x.float(), output_type=output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (image,)
        return ImagePipelineOutput(images=image)


# ---------------------------------------------------------------------- weights in
def _mismatch(theirs: dict, ours: dict) -> str:
    keys = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
    return ", ".join(f"{k}: source {theirs.get(k)!r} vs run {ours.get(k)!r}" for k in keys[:4])


def init_from(comp, path: str) -> str:
    """Initialise a run's components (pipelines/text2image/components.py) from `path`: an exported
    pipeline folder (its transformer or unet, and its open_clip text tower when the run uses one),
    or a run / checkpoint directory of the same architecture (the checkpoint's EMA weights where
    it has them, and its frozen text tower when the text config matches). The text tower is taken
    along because the denoiser was trained on its features. Returns what was loaded, for the log."""
    from common.checkpoint import CheckpointError
    from common.config import ConfigError
    from pipelines.text2image.components import signature
    if not os.path.isdir(path):
        raise ConfigError(f"model.init_from={path!r} is not a directory (a run, checkpoint or exported pipeline folder)")
    if os.path.isfile(os.path.join(path, "model_index.json")):
        return _init_from_pipeline(comp, path)
    if hasattr(comp.model, "unet") and unet_folder(path) == path:
        return f"{_load_unet(comp, path)} (a UNet folder)"
    if isinstance(comp.model, pixart.PixArt) and pixart_folder(path) == path:
        return f"{_load_pixart(comp, path)} (a PixArt transformer folder)"
    if isinstance(comp.model, sd3.SD3) and sd3_folder(path) == path:
        return f"{_load_sd3(comp, path)} (an SD3 transformer folder)"
    from common.checkpoint import load_for_inference, read_meta, resolve_checkpoint
    try:
        ckpt = resolve_checkpoint(path)
    except CheckpointError as e:
        raise ConfigError(f"model.init_from: {e}") from None
    theirs, ours = read_meta(ckpt).get("signature", {}), signature(comp.cfg, comp)
    if theirs.get("model") != ours["model"]:
        raise ConfigError(f"model.init_from={path}: the checkpoint's model differs from this run's "
                          f"({_mismatch(theirs.get('model') or {}, ours['model'])})")
    same_text = theirs.get("text") == ours["text"]
    ema = checkpoint_has_ema(ckpt)
    load_for_inference(ckpt, comp.model, comp.frozen if same_text else {}, signature=None, use_ema=ema)
    comp.model.train()
    return (f"{'EMA' if ema else 'trained'} weights of {ckpt}"
            + ("" if same_text else " (its text tower differs from this run's: kept this run's)"))


def _load_diffusers_weights(module, folder: str, cls, mismatch, what: str) -> None:
    """The weights of the diffusers `cls` model in `folder` (any file layout diffusers reads:
    safetensors, sharded, .bin, or one precision variant such as SD's fp16 files, cast to fp32)
    into `module`, after checking the two are the same architecture."""
    from common.config import ConfigError
    with open(os.path.join(folder, "config.json")) as f:
        wrong = mismatch(module, json.load(f))
    if wrong:
        raise ConfigError(f"model.init_from={folder}: its {what} differs from this run's ({'; '.join(wrong[:4])}); "
                          "model.preset=folder takes the folder's architecture")
    source = cls.from_pretrained(folder, local_files_only=True, low_cpu_mem_usage=False,
                                 variant=weights_variant(folder), torch_dtype=torch.float32)
    module.load_state_dict(source.state_dict())  # strict: a shape or key mismatch names the keys


def _load_unet(comp, folder: str) -> str:
    _load_diffusers_weights(comp.model.unet, folder, UNet2DConditionModel, diffusers_config_mismatch, "UNet")
    return "unet"


def _load_pixart(comp, folder: str) -> str:
    from diffusers import PixArtTransformer2DModel
    _load_diffusers_weights(comp.model.transformer, folder, PixArtTransformer2DModel,
                            pixart.diffusers_config_mismatch, "PixArt transformer")
    return "transformer"


def _load_sd3(comp, folder: str) -> str:
    from diffusers import SD3Transformer2DModel
    _load_diffusers_weights(comp.model.transformer, folder, SD3Transformer2DModel, sd3.diffusers_config_mismatch,
                            "SD3 transformer")
    return "transformer"


# The diffusers transformers a pipeline folder's transformer/ may hold that a model.arch trains.
_TRANSFORMER_ARCH = {pixart.CLASS_NAME: "pixart", sd3.CLASS_NAME: "sd3"}


def _init_from_pipeline(comp, path: str) -> str:
    from safetensors.torch import load_file

    from common.config import ConfigError

    def weights(sub: str, prefix: str = "") -> dict:
        files = [f for f in os.listdir(os.path.join(path, sub)) if f.endswith(".safetensors")]
        if len(files) != 1:
            raise ConfigError(f"model.init_from={path}: expected one safetensors file in {sub}/, found {files}")
        sd = load_file(os.path.join(path, sub, files[0]))
        return {k.removeprefix(prefix): v for k, v in sd.items()}

    def config(sub: str) -> dict:
        with open(os.path.join(path, sub, "config.json")) as f:
            return json.load(f)

    loaded = []
    if isinstance(comp.model, pixart.PixArt) and pixart_folder(path) == os.path.join(path, "transformer"):
        loaded.append(_load_pixart(comp, os.path.join(path, "transformer")))
    elif isinstance(comp.model, sd3.SD3) and sd3_folder(path) == os.path.join(path, "transformer"):
        loaded.append(_load_sd3(comp, os.path.join(path, "transformer")))
    elif os.path.isdir(os.path.join(path, "transformer")):
        held = config("transformer").get("_class_name")
        if held != TextToImageDiTModel.__name__:
            arch = _TRANSFORMER_ARCH.get(held)
            hint = f" (model.arch={arch} model.preset=folder trains it)" if arch else ""
            raise ConfigError(f"model.init_from={path} holds a {held} (transformer/){hint}, this run's model is "
                              f"{type(comp.model).__name__}")
        if not isinstance(comp.model, DiT):
            raise ConfigError(f"model.init_from={path} holds a DiT (transformer/), this run's model is "
                              f"{type(comp.model).__name__}")
        theirs, ours = config("transformer")["dit_config"], dataclasses.asdict(comp.model.cfg)
        if theirs != ours:
            raise ConfigError(f"model.init_from={path}: its DiT differs from this run's ({_mismatch(theirs, ours)})")
        comp.model.load_state_dict(weights("transformer", "dit."))
        loaded.append("transformer")
    elif os.path.isdir(os.path.join(path, "unet")) and hasattr(comp.model, "unet"):
        loaded.append(_load_unet(comp, os.path.join(path, "unet")))
    else:
        wanted = {pixart.PixArt: pixart.CLASS_NAME, sd3.SD3: sd3.CLASS_NAME}.get(type(comp.model))
        raise ConfigError(f"model.init_from={path}: no transformer/ or unet/ folder for a {type(comp.model).__name__}"
                          + (f" (a {wanted} in transformer/)" if wanted else ""))
    text_dir = os.path.join(path, "text_encoder")
    if isinstance(comp.text_encoder, TextEncoder) and os.path.isdir(text_dir):
        c = config("text_encoder")
        if c.get("_class_name") != OpenCLIPTextModel.__name__:
            # The denoiser learned that encoder's features; a random open_clip tower would give it noise.
            raise ConfigError(f"model.init_from={path}: its denoiser was trained with the text encoder in {text_dir} "
                              f"({c.get('architectures') or c.get('_class_name')}); "
                              f"set text.hf_path={text_dir} (and text.width to its hidden size)")
        ours = dataclasses.asdict(comp.text_encoder.cfg)
        if all(c.get(k) == ours[k] for k in ("width", "layers", "heads", "context_length", "vocab_size")):
            comp.text_encoder.load_state_dict(weights("text_encoder", "encoder."))
            loaded.append("text_encoder")
    return f"{' and '.join(loaded)} of the pipeline folder {path}"
