"""The text2image run configuration: the shared sections from common.config plus this pipeline's."""
from __future__ import annotations

from dataclasses import dataclass

from common.config import ConfigError, DiffusionConfig, ModelSizeConfig, TextDiffusionSections, doc
from common.diffusion.ddpm import SCHEDULES

# model.arch -> its model.preset choices (pipelines/text2image/model.py, unet.py).
ARCH_PRESETS = {"dit": ("tiny", "S", "B", "XL"), "unet": ("tiny", "sd15", "sdxl", "folder")}


@dataclass
class ModelConfig(ModelSizeConfig):
    arch: str = doc("dit", "dit: the DiT (preset and the size fields below) | unet: a Stable-Diffusion-style UNet "
                           "(diffusers UNet2DConditionModel), sized by preset alone")
    preset: str = doc("tiny", "model size. dit: tiny | S | B | XL; unet: tiny | sd15 | sdxl (SD1.x / SDXL sizes, "
                              "cross-attention width = text.width) | folder (the architecture and weights of the "
                              "diffusers UNet in model.init_from, e.g. a Stable Diffusion 1.x / 2.x folder)")
    image_size: int = doc(32, "pixel resolution of training images (square)")
    init_from: str = doc("", "start from the weights of a run / checkpoint dir (its EMA copy), an exported "
                             "diffusers pipeline folder of the same architecture (and its open_clip tower), or "
                             "with model.preset=folder any diffusers pipeline or UNet folder (its unet/ or itself)")


@dataclass
class VaeConfig:
    path: str = doc("", "local diffusers AutoencoderKL folder; empty: train in pixel space")
    scaling_factor: float = doc(0.0, "latent scale (0: the VAE config's scaling_factor)")


@dataclass
class T2IDiffusionConfig(DiffusionConfig):
    objective: str = doc("flow", "flow (rectified flow, velocity) | ddpm")
    ddpm_prediction: str = doc("eps", "ddpm: eps | v")
    ddpm_schedule: str = doc("cosine", "ddpm: linear | cosine | scaled_linear (Stable Diffusion's betas, "
                                       "0.00085-0.012 in sqrt space: for fine-tuning an SD UNet)")


@dataclass
class T2IConfig(TextDiffusionSections):
    diffusion: T2IDiffusionConfig = doc(factory=T2IDiffusionConfig, help="training objective")
    model: ModelConfig = doc(factory=ModelConfig, help="the denoiser: DiT or UNet")
    vae: VaeConfig = doc(factory=VaeConfig, help="optional latent space")

    def validate(self) -> None:
        m = self.model
        self.check(positive={"model.image_size": m.image_size}, choices={
            "diffusion.objective": (self.diffusion.objective, ("flow", "ddpm")),
            "diffusion.ddpm_prediction": (self.diffusion.ddpm_prediction, ("eps", "v")),
            "diffusion.ddpm_schedule": (self.diffusion.ddpm_schedule, SCHEDULES),
            "model.arch": (m.arch, tuple(ARCH_PRESETS)),
        })
        if m.preset not in ARCH_PRESETS[m.arch]:
            raise ConfigError(f"model.preset={m.preset!r} is not a {m.arch} preset; choose from "
                              f"{', '.join(ARCH_PRESETS[m.arch])}")
        if m.preset == "folder" and not m.init_from:
            raise ConfigError("model.preset=folder takes the UNet's architecture and weights from model.init_from: "
                              "set it to a diffusers pipeline folder (with unet/) or a UNet folder")
        if m.arch == "unet":
            # The DiT's size fields would do nothing: refused rather than silently ignored.
            sized = m.size_overrides()
            if sized:
                key, value = next(iter(sized.items()))
                raise ConfigError(f"model.{key}={value} sizes the DiT; model.arch=unet is sized by model.preset "
                                  f"({', '.join(ARCH_PRESETS['unet'])}): leave model.{key} unset")
            # Refused here, before any process starts, for the reasons the model's plan gives.
            from pipelines.text2image.unet import PARALLEL_LIMITS
            for dim, reason in PARALLEL_LIMITS.items():
                degree = getattr(self.parallel, dim)
                if degree > 1:
                    raise ConfigError(f"parallel.{dim}={degree} is not supported for text2image with "
                                      f"model.arch=unet: {reason}")
