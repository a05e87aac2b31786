"""The text2image run configuration: the shared sections from common.config plus this pipeline's."""
from __future__ import annotations

from dataclasses import dataclass

from common.config import (ConfigError, DataConfig, OptimConfig, ParallelConfig, RunConfig, TextConfig, TrainConfig,
                           check_run_config, doc)


@dataclass
class ModelConfig:
    preset: str = doc("tiny", "tiny | S | B | XL: DiT size; the fields below override the preset where set (> 0)")
    image_size: int = doc(32, "pixel resolution of training images (square)")
    patch_size: int = doc(0, "patch size in model-input pixels or latents (0: preset)")
    hidden: int = doc(0, "transformer width (0: preset)")
    depth: int = doc(0, "number of DiT blocks (0: preset)")
    heads: int = doc(0, "attention heads (0: preset)")
    mlp_ratio: float = doc(0.0, "MLP hidden / width (0: preset)")


@dataclass
class VaeConfig:
    path: str = doc("", "local diffusers AutoencoderKL folder; empty: train in pixel space")
    scaling_factor: float = doc(0.0, "latent scale (0: the VAE config's scaling_factor)")


@dataclass
class DiffusionConfig:
    objective: str = doc("flow", "flow (rectified flow, velocity) | ddpm")
    timesteps: str = doc("logit_normal", "flow: logit_normal | uniform")
    logit_mean: float = doc(0.0, "flow: logit-normal mean")
    logit_std: float = doc(1.0, "flow: logit-normal std")
    shift: float = doc(0.0, "flow: fixed timestep shift (0: resolution dependent, base_shift * sqrt(tokens / base_tokens))")
    base_shift: float = doc(1.0, "flow: shift at base_tokens")
    base_tokens: int = doc(256, "flow: token count where the shift equals base_shift")
    ddpm_prediction: str = doc("eps", "ddpm: eps | v")
    ddpm_schedule: str = doc("cosine", "ddpm: linear | cosine")
    cfg_dropout: float = doc(0.1, "probability of replacing a caption by the empty caption (classifier-free guidance)")


@dataclass
class SampleConfig:
    steps: int = doc(30, "sampler steps")
    cfg: float = doc(3.0, "classifier-free guidance weight (1: no guidance)")
    num: int = doc(16, "images in the training-time sample grid (captions from data.eval_shards)")
    seed: int = doc(1234, "seed of the sample grid's noise")


@dataclass
class T2IConfig:
    run: RunConfig = doc(factory=RunConfig, help="run directory, seed, resume")
    data: DataConfig = doc(factory=DataConfig, help="shards and loader")
    optim: OptimConfig = doc(factory=OptimConfig, help="AdamW and LR schedule")
    train: TrainConfig = doc(factory=TrainConfig, help="loop length, logging, checkpoints, EMA")
    parallel: ParallelConfig = doc(factory=ParallelConfig, help="data parallelism")
    model: ModelConfig = doc(factory=ModelConfig, help="the DiT")
    text: TextConfig = doc(factory=TextConfig, help="the frozen open_clip text tower")
    vae: VaeConfig = doc(factory=VaeConfig, help="optional latent space")
    diffusion: DiffusionConfig = doc(factory=DiffusionConfig, help="training objective")
    sample: SampleConfig = doc(factory=SampleConfig, help="sample grids")

    def validate(self) -> None:
        check_run_config(self, positive={
            "model.image_size": self.model.image_size, "sample.steps": self.sample.steps,
            "text.context_length": self.text.context_length,
        }, choices={
            "diffusion.objective": (self.diffusion.objective, ("flow", "ddpm")),
            "diffusion.timesteps": (self.diffusion.timesteps, ("logit_normal", "uniform")),
            "diffusion.ddpm_prediction": (self.diffusion.ddpm_prediction, ("eps", "v")),
            "diffusion.ddpm_schedule": (self.diffusion.ddpm_schedule, ("linear", "cosine")),
            "model.preset": (self.model.preset, ("tiny", "S", "B", "XL")),
        })
        if not 0.0 <= self.diffusion.cfg_dropout < 1.0:
            raise ConfigError(f"diffusion.cfg_dropout={self.diffusion.cfg_dropout} must be in [0, 1)")
