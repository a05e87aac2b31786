"""The text2image run configuration: the shared sections from common.config plus this pipeline's."""
from __future__ import annotations

from dataclasses import dataclass

from common.config import DiffusionConfig, ModelSizeConfig, TextDiffusionSections, doc


@dataclass
class ModelConfig(ModelSizeConfig):
    image_size: int = doc(32, "pixel resolution of training images (square)")


@dataclass
class VaeConfig:
    path: str = doc("", "local diffusers AutoencoderKL folder; empty: train in pixel space")
    scaling_factor: float = doc(0.0, "latent scale (0: the VAE config's scaling_factor)")


@dataclass
class T2IDiffusionConfig(DiffusionConfig):
    objective: str = doc("flow", "flow (rectified flow, velocity) | ddpm")
    ddpm_prediction: str = doc("eps", "ddpm: eps | v")
    ddpm_schedule: str = doc("cosine", "ddpm: linear | cosine")


@dataclass
class T2IConfig(TextDiffusionSections):
    diffusion: T2IDiffusionConfig = doc(factory=T2IDiffusionConfig, help="training objective")
    model: ModelConfig = doc(factory=ModelConfig, help="the DiT")
    vae: VaeConfig = doc(factory=VaeConfig, help="optional latent space")

    def validate(self) -> None:
        self.check(positive={"model.image_size": self.model.image_size}, choices={
            "diffusion.objective": (self.diffusion.objective, ("flow", "ddpm")),
            "diffusion.ddpm_prediction": (self.diffusion.ddpm_prediction, ("eps", "v")),
            "diffusion.ddpm_schedule": (self.diffusion.ddpm_schedule, ("linear", "cosine")),
            "model.preset": (self.model.preset, ("tiny", "S", "B", "XL")),
        })
