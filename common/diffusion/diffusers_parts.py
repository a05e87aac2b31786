"""What the diffusers pipelines of the text-conditioned diffusion runs share (text2image and
text2video): the open_clip text tower as a diffusers component (`OpenCLIPTextModel`), the native
scheduler that takes our sampler's steps (`scheduler_for`, `set_sampler_timesteps`), the per-seed
noise of sample.py (`seeded_noise`) and the base class that writes and drops the folder's one-line
loader shim (`ShimmedPipeline`). The export commands' checks and atomic write are in
common/diffusion/pipeline_export.py (no diffusers import: their errors come before it).

A component's library in model_index.json is its class's __module__ (diffusers'
_fetch_class_library_tuple), and diffusers finds its load method by the base classes that module
exposes by name: the ModelMixin import below is what makes OpenCLIPTextModel loadable from here.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import torch
from diffusers import DiffusionPipeline, DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, ModelMixin
from diffusers.configuration_utils import ConfigMixin, register_to_config

from common.diffusion.samplers import ddim_timesteps
from common.nn.text_encoder import TextEncoder, TextEncoderConfig, hf_text_features

__all__ = ["NUM_TRAIN_TIMESTEPS", "SHIM", "ModelMixin", "OpenCLIPTextModel", "ShimmedPipeline", "WrappedDiT",
           "encode_captions",
           "scheduler_for", "set_sampler_timesteps", "seeded_noise", "write_loader_shim"]

NUM_TRAIN_TIMESTEPS = 1000  # diffusers' timestep units: model time t in [0, 1] is t * 1000
SHIM = "pipeline"


class WrappedDiT(ModelMixin, ConfigMixin):
    """Base of the diffusers wrappers of our DiTs (each pipeline's subclass builds its model as
    `dit` from a `dit_config` dict in a @register_to_config __init__): the model's parameters keep
    our names under `dit.`, and it is called the diffusers way, timesteps in
    [0, num_train_timesteps] (0 = data)."""

    @classmethod
    def from_dit(cls, dit):
        """Wraps `dit` itself (no copy of its weights)."""
        with torch.device("meta"):  # the throwaway model the constructor builds costs no memory
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
        with torch.device("meta"):  # the throwaway tower the constructor builds costs no memory
            wrapper = cls(width=c.width, layers=c.layers, heads=c.heads, context_length=c.context_length,
                          vocab_size=c.vocab_size, layer_scale=c.layer_scale)
        wrapper.encoder = enc
        return wrapper

    def forward(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encoder(texts)


def encode_captions(text_encoder, tokenizer, prompts: list[str], max_length: int,
                    padding_mask: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B, L, width), mask (B, L) bool) of a pipeline's text tower, as the training run's
    gives them: an OpenCLIPTextModel tokenizes itself (tokenizer None), a transformers encoder gets
    its tokenizer's ids padded / truncated to max_length (the run's text.context_length), with the
    padding mask unless padding_mask is False (the run's text.hf_padding_mask)."""
    if tokenizer is None:
        return text_encoder(list(prompts))
    return hf_text_features(text_encoder, tokenizer, list(prompts), max_length, padding_mask)


# ---------------------------------------------------------------------- sampling
def scheduler_for(objective, num_tokens: int):
    """The native diffusers scheduler that takes our sampler's steps for `objective`
    (common.diffusion RectifiedFlow | DDPM) at `num_tokens` tokens; the pipeline sets its timesteps
    (set_sampler_timesteps)."""
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


def set_sampler_timesteps(scheduler, num_inference_steps: int, device) -> None:
    """The steps of common.diffusion.samplers: Euler over shift(linspace(1, 0, n + 1)) for flow
    (the scheduler applies its shift), DDIM over linspace(T - 1, 0, n).round() for DDPM."""
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_inference_steps + 1)[:-1].tolist(), device=device)
    else:
        scheduler.set_timesteps(timesteps=ddim_timesteps(scheduler.config.num_train_timesteps, num_inference_steps),
                                device=device)
    scheduler.set_begin_index(0)


def seeded_noise(n: int, shape, generator, seed, latents, device, dtype) -> torch.Tensor:
    """(n, *shape) initial noise: `latents` as given, else per `seed` (prompt i draws
    torch.Generator().manual_seed(seed + i), as sample.py --seed does; or one seed per prompt),
    else from `generator` (one per prompt, or one for the batch)."""
    if latents is not None:
        return latents.to(device=device, dtype=dtype)
    if seed is not None:
        seeds = [seed + i for i in range(n)] if isinstance(seed, int) else list(seed)
        generator = [torch.Generator().manual_seed(int(s)) for s in seeds]
    if isinstance(generator, list):
        if len(generator) != n:
            raise ValueError(f"{len(generator)} generators or seeds for {n} prompts")
        noise = torch.stack([torch.randn(shape, generator=g, device=g.device) for g in generator])
    else:
        noise = torch.randn((n, *shape), generator=generator, device=generator.device if generator is not None else "cpu")
    return noise.to(device=device, dtype=dtype)


# ---------------------------------------------------------------------- loading
def write_loader_shim(folder: str, module: str, class_name: str) -> None:
    """Name the pipeline class `module`.`class_name` in model_index.json through a one-line
    pipeline.py, the way DiffusionPipeline.from_pretrained(folder, trust_remote_code=True) finds a
    class outside diffusers."""
    with open(os.path.join(folder, SHIM + ".py"), "w") as f:
        f.write(f"# Loads {class_name} of the installed project (pip install -e <repo>).\n"
                f"from {module} import {class_name}  # noqa: F401\n")
    path = os.path.join(folder, "model_index.json")
    with open(path) as f:
        index = json.load(f)
    index["_class_name"] = [SHIM, class_name]
    with open(path, "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")


class ShimmedPipeline(DiffusionPipeline):
    """A DiffusionPipeline of this project: save_pretrained adds the loader shim (pipeline.py naming
    the subclass), and SubClass.from_pretrained(folder) runs no code from the folder."""

    @classmethod
    def load_config(cls, *args, **kwargs):
        # Called on the class itself, the folder's pipeline.py shim (which only names this class)
        # is not needed: dropping it from _class_name keeps diffusers from executing it.
        out = super().load_config(*args, **kwargs)
        config = out[0] if isinstance(out, tuple) else out
        if isinstance(config.get("_class_name"), list) and config["_class_name"][0] == SHIM:
            config["_class_name"] = config["_class_name"][1]
        return out

    def save_pretrained(self, save_directory, *args, **kwargs):
        super().save_pretrained(save_directory, *args, **kwargs)
        write_loader_shim(save_directory, type(self).__module__, type(self).__name__)

    def guided_context(self, prompts: list[str], negative_prompt, guided: bool, device):
        """(tokens, mask) of `prompts` through the subclass's encode_prompt, followed, when guided,
        by those of the unconditional branch: the empty caption the run dropped captions to
        (encoded once), or negative_prompt (one string, or one per prompt)."""
        ctx, mask = self.encode_prompt(prompts)
        if guided:
            if negative_prompt is None:
                uctx, umask = self.encode_prompt([""])
                uctx, umask = uctx.expand(len(prompts), -1, -1), umask.expand(len(prompts), -1)
            else:
                negs = [negative_prompt] * len(prompts) if isinstance(negative_prompt, str) else list(negative_prompt)
                uctx, umask = self.encode_prompt(negs)
            ctx, mask = torch.cat([ctx, uctx]), torch.cat([mask, umask])
        return ctx.to(device), mask.to(device)
