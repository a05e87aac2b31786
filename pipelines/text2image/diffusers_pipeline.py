"""A text2image run as a diffusers pipeline: `TextToImagePipeline` and the two components diffusers
has no class for, our DiT (`TextToImageDiTModel`) and the open_clip text tower (`OpenCLIPTextModel`),
as ModelMixin + ConfigMixin wrappers that save and load safetensors with `save_pretrained` /
`from_pretrained`. A pipeline folder (written by pipelines/text2image/export.py) holds:

  model_index.json   _class_name ["pipeline", "TextToImagePipeline"]; our components are named by
                     their module path (pipelines.text2image.diffusers_pipeline)
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

import numpy as np
import torch
from diffusers import (AutoencoderKL, DiffusionPipeline, DPMSolverMultistepScheduler,
                       FlowMatchEulerDiscreteScheduler, ModelMixin, UNet2DConditionModel)
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput

from common.nn.text_encoder import TextEncoder, TextEncoderConfig, hf_text_features
from pipelines.text2image.model import DiT, DiTConfig
from pipelines.text2image.unet import run_unet

# diffusers finds a component's load method by the base classes its module exposes by name: this
# module's ModelMixin import (above) is what makes its wrappers loadable.
__all__ = ["TextToImageDiTModel", "OpenCLIPTextModel", "TextToImagePipeline", "scheduler_for", "write_loader_shim"]

NUM_TRAIN_TIMESTEPS = 1000  # diffusers' timestep units: model time t in [0, 1] is t * 1000
SHIM = "pipeline"


class TextToImageDiTModel(ModelMixin, ConfigMixin):
    """pipelines.text2image.model.DiT (held as `dit`: its parameters keep our names under `dit.`),
    called the diffusers way: timesteps in [0, num_train_timesteps] (0 = data)."""

    @register_to_config
    def __init__(self, dit_config: dict | None = None, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS):
        super().__init__()
        self.dit = DiT(DiTConfig(**(dit_config or {})))

    @classmethod
    def from_dit(cls, dit: DiT) -> "TextToImageDiTModel":
        """Wraps `dit` itself (no copy of its weights)."""
        with torch.device("meta"):  # the throwaway DiT the constructor builds costs no memory
            wrapper = cls(dit_config=dataclasses.asdict(dit.cfg))
        wrapper.dit = dit
        return wrapper

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_attention_mask: torch.Tensor | None = None, return_dict: bool = True):
        t = torch.as_tensor(timestep, device=hidden_states.device).float().reshape(-1)
        t = t.expand(hidden_states.shape[0]) / self.config.num_train_timesteps
        out = self.dit(hidden_states, t, encoder_hidden_states, encoder_attention_mask)
        if not return_dict:
            return (out,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput
        return Transformer2DModelOutput(sample=out)


class OpenCLIPTextModel(ModelMixin, ConfigMixin):
    """The frozen open_clip text tower (common.nn.text_encoder.TextEncoder, held as `encoder`) with
    its bundled BPE tokenizer: forward(list of captions) -> (tokens (B, L, width), mask (B, L))."""

    @register_to_config
    def __init__(self, width: int = 128, layers: int = 2, heads: int = 4, context_length: int = 32,
                 vocab_size: int = 49408, layer_scale: float | None = None):
        super().__init__()
        self.encoder = TextEncoder(TextEncoderConfig(width=width, layers=layers, heads=heads,
                                                     context_length=context_length, vocab_size=vocab_size,
                                                     layer_scale=layer_scale))

    @classmethod
    def from_encoder(cls, enc: TextEncoder) -> "OpenCLIPTextModel":
        c = enc.cfg
        with torch.device("meta"):
            wrapper = cls(width=c.width, layers=c.layers, heads=c.heads, context_length=c.context_length,
                          vocab_size=c.vocab_size, layer_scale=c.layer_scale)
        wrapper.encoder = enc
        return wrapper

    def forward(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encoder(texts)


def scheduler_for(objective, num_tokens: int):
    """The native diffusers scheduler that takes our sampler's steps for `objective`
    (common.diffusion RectifiedFlow | DDPM); TextToImagePipeline sets its timesteps."""
    from common.diffusion import DDPM, RectifiedFlow
    if isinstance(objective, RectifiedFlow):
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=NUM_TRAIN_TIMESTEPS,
                                               shift=objective.shift_for(num_tokens))
    if isinstance(objective, DDPM):
        # First-order DPM-Solver++ is DDIM with eta = 0 (the same update, written in log-SNR); unlike
        # DDIMScheduler (which steps to t - T / n) it follows a given timestep list, and
        # final_sigmas_type=zero ends on the predicted x0 as our DDIM does.
        return DPMSolverMultistepScheduler(num_train_timesteps=objective.num_timesteps,
                                           trained_betas=objective.betas.tolist(), solver_order=1,
                                           algorithm_type="dpmsolver++", final_sigmas_type="zero",
                                           prediction_type="epsilon" if objective.prediction == "eps" else "v_prediction")
    raise TypeError(f"no diffusers scheduler for the objective {type(objective).__name__}")


def write_loader_shim(folder: str, class_name: str = "TextToImagePipeline") -> None:
    """Name the pipeline class in model_index.json through a one-line pipeline.py, the way
    DiffusionPipeline.from_pretrained(folder, trust_remote_code=True) finds a class outside diffusers."""
    with open(os.path.join(folder, SHIM + ".py"), "w") as f:
        f.write("# Loads the text2image pipeline of the installed project (pip install -e <repo>).\n"
                f"from pipelines.text2image.diffusers_pipeline import {class_name}  # noqa: F401\n")
    path = os.path.join(folder, "model_index.json")
    with open(path) as f:
        index = json.load(f)
    index["_class_name"] = [SHIM, class_name]
    with open(path, "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")


class TextToImagePipeline(DiffusionPipeline):
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
                 sample_steps: int = 30, sample_guidance: float = 3.0):
        super().__init__()
        if (transformer is None) == (unet is None):
            raise ValueError("TextToImagePipeline needs exactly one denoiser: transformer or unet")
        self.register_modules(transformer=transformer, unet=unet, text_encoder=text_encoder, tokenizer=tokenizer,
                              vae=vae, scheduler=scheduler)
        # text_max_length: tokens per caption for a transformers text encoder (the run's
        # text.context_length). The UNet as pipelines/text2image/unet.py runs it: the masked mean
        # of the text tokens as class_labels (unet_pooled_text), inputs space-to-depth by
        # unet_patch_size (pixel_unshuffle before, pixel_shuffle after).
        # sample_steps / sample_guidance: the defaults of __call__ (the run's sample.steps / sample.cfg,
        # as sample.py's).
        self.register_to_config(text_max_length=text_max_length, unet_pooled_text=unet_pooled_text,
                                unet_patch_size=unet_patch_size, sample_steps=sample_steps,
                                sample_guidance=sample_guidance)
        factor = 2 ** (len(vae.config.block_out_channels) - 1) if vae is not None else 1
        self.image_processor = VaeImageProcessor(vae_scale_factor=factor, do_normalize=True)

    @classmethod
    def load_config(cls, *args, **kwargs):
        # Called on this class itself, the folder's pipeline.py shim (which only names this class)
        # is not needed: dropping it from _class_name keeps diffusers from executing it.
        out = super().load_config(*args, **kwargs)
        config = out[0] if isinstance(out, tuple) else out
        if isinstance(config.get("_class_name"), list) and config["_class_name"][0] == SHIM:
            config["_class_name"] = config["_class_name"][1]
        return out

    def save_pretrained(self, save_directory, *args, **kwargs):
        super().save_pretrained(save_directory, *args, **kwargs)
        write_loader_shim(save_directory, type(self).__name__)

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
        if self.tokenizer is None:  # OpenCLIPTextModel tokenizes itself
            return self.text_encoder(list(prompts))
        return hf_text_features(self.text_encoder, self.tokenizer, list(prompts), self.config.text_max_length)

    def set_timesteps(self, num_inference_steps: int, device) -> None:
        """The steps of common.diffusion.samplers: Euler over shift(linspace(1, 0, n + 1)) for
        flow (the scheduler applies the shift), DDIM over linspace(T - 1, 0, n).round() for DDPM."""
        s = self.scheduler
        if isinstance(s, FlowMatchEulerDiscreteScheduler):
            s.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_inference_steps + 1)[:-1].tolist(), device=device)
        else:
            steps = torch.linspace(s.config.num_train_timesteps - 1, 0, num_inference_steps).round().long()
            s.set_timesteps(timesteps=steps.tolist(), device=device)
        s.set_begin_index(0)

    def predict(self, x: torch.Tensor, t: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        t = t.reshape(-1).expand(x.shape[0])
        if self.transformer is not None:
            return self.transformer(x, t, ctx, mask, return_dict=False)[0]
        return run_unet(self.unet, x, t.float(), ctx, mask, pooled_text=self.config.unet_pooled_text,
                        patch_size=self.config.unet_patch_size)

    def _noise(self, n: int, shape, generator, seed, latents, device, dtype) -> torch.Tensor:
        if latents is not None:
            return latents.to(device=device, dtype=dtype)
        if seed is not None:  # sample.py's --seed: prompt i gets seed + i
            seeds = [seed + i for i in range(n)] if isinstance(seed, int) else list(seed)
            generator = [torch.Generator().manual_seed(int(s)) for s in seeds]
        if isinstance(generator, list):
            if len(generator) != n:
                raise ValueError(f"{len(generator)} generators for {n} prompts")
            noise = torch.stack([torch.randn(shape, generator=g, device=g.device) for g in generator])
        else:
            noise = torch.randn((n, *shape), generator=generator,
                                device=generator.device if generator is not None else "cpu")
        return noise.to(device=device, dtype=dtype)

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
        ctx, mask = self.encode_prompt(prompts)
        guided = guidance_scale != 1.0
        if guided:
            if negative_prompt is None:  # the empty caption the run dropped captions to, encoded once
                uctx, umask = self.encode_prompt([""])
                uctx, umask = uctx.expand(len(prompts), -1, -1), umask.expand(len(prompts), -1)
            else:
                negs = [negative_prompt] * len(prompts) if isinstance(negative_prompt, str) else list(negative_prompt)
                uctx, umask = self.encode_prompt(negs)
            ctx, mask = torch.cat([ctx, uctx]), torch.cat([mask, umask])
        ctx, mask = ctx.to(device), mask.to(device)
        x = self._noise(len(prompts), self.model_shape, generator, seed, latents, device, torch.float32)
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
                x = self.vae.decode(x.to(self.vae.dtype) / self.vae.config.scaling_factor).sample
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


def checkpoint_has_ema(ckpt: str) -> bool:
    """Whether a complete checkpoint directory holds an EMA copy of the model."""
    import torch.distributed.checkpoint as dcp
    keys = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    return any(k.startswith("ema.") for k in keys)


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
    if os.path.isdir(os.path.join(path, "transformer")):
        if not isinstance(comp.model, DiT):
            raise ConfigError(f"model.init_from={path} holds a DiT (transformer/), this run's model is "
                              f"{type(comp.model).__name__}")
        theirs, ours = config("transformer")["dit_config"], dataclasses.asdict(comp.model.cfg)
        if theirs != ours:
            raise ConfigError(f"model.init_from={path}: its DiT differs from this run's ({_mismatch(theirs, ours)})")
        comp.model.load_state_dict(weights("transformer", "dit."))
        loaded.append("transformer")
    elif os.path.isdir(os.path.join(path, "unet")) and hasattr(comp.model, "unet"):
        comp.model.unet.load_state_dict(weights("unet"))  # strict: a shape or key mismatch names the keys
        loaded.append("unet")
    else:
        raise ConfigError(f"model.init_from={path}: no transformer/ or unet/ folder for a {type(comp.model).__name__}")
    text_dir = os.path.join(path, "text_encoder")
    if isinstance(comp.text_encoder, TextEncoder) and os.path.isdir(text_dir) \
            and config("text_encoder").get("_class_name") == OpenCLIPTextModel.__name__:
        c = config("text_encoder")
        ours = dataclasses.asdict(comp.text_encoder.cfg)
        if all(c.get(k) == ours[k] for k in ("width", "layers", "heads", "context_length", "vocab_size")):
            comp.text_encoder.load_state_dict(weights("text_encoder", "encoder."))
            loaded.append("text_encoder")
    return f"{' and '.join(loaded)} of the pipeline folder {path}"
