"""The text2image run configuration: the shared sections from common.config plus this pipeline's."""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from common.config import ConfigError, DiffusionConfig, ModelSizeConfig, TextDiffusionSections, doc
from common.diffusion.ddpm import SCHEDULES

# model.arch -> its model.preset choices (pipelines/text2image/model.py, unet.py, pixart.py, sd3.py).
ARCH_PRESETS = {"dit": ("tiny", "S", "B", "XL"), "unet": ("tiny", "sd15", "sdxl", "folder"),
                "pixart": ("tiny", "xl", "folder"), "sd3": ("tiny", "medium", "folder")}
# The diffusers-backed transformers: (what, the folder of a pipeline that holds one).
_FOLDER_MODELS = {"unet": ("UNet", "unet"), "pixart": ("PixArt transformer", "transformer"),
                  "sd3": ("SD3 transformer", "transformer")}


@dataclass
class ModelConfig(ModelSizeConfig):
    arch: str = doc("dit", "dit: the DiT (preset and the size fields below) | unet: a Stable-Diffusion-style UNet "
                           "(diffusers UNet2DConditionModel), sized by preset alone | pixart: a PixArt-alpha/Sigma "
                           "transformer (diffusers PixArtTransformer2DModel; preset and the size fields) | "
                           "sd3: a Stable Diffusion 3-style MMDiT (diffusers SD3Transformer2DModel; preset and the "
                           "size fields)")
    preset: str = doc("tiny", "model size. dit: tiny | S | B | XL; unet: tiny | sd15 | sdxl (SD1.x / SDXL sizes, "
                              "cross-attention width = text.width) | folder (the architecture and weights of the "
                              "diffusers UNet in model.init_from, e.g. a Stable Diffusion 1.x / 2.x folder); "
                              "pixart: tiny | xl (PixArt XL/2) | folder (the PixArt transformer in model.init_from); "
                              "sd3: tiny | medium (SD3 Medium's transformer) | folder (the SD3 transformer in "
                              "model.init_from)")
    image_size: int = doc(32, "pixel resolution of training images (square)")
    init_from: str = doc("", "start from the weights of a run / checkpoint dir (its EMA copy), an exported "
                             "diffusers pipeline folder of the same architecture (and its open_clip tower), or "
                             "with model.preset=folder any diffusers pipeline or UNet / PixArt / SD3 transformer "
                             "folder (its unet/ or transformer/, or itself)")


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
    model: ModelConfig = doc(factory=ModelConfig, help="the denoiser: DiT, UNet, PixArt or SD3 transformer")
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
            what, sub = _FOLDER_MODELS[m.arch]
            raise ConfigError(f"model.preset=folder takes the {what}'s architecture and weights from model.init_from: "
                              f"set it to a diffusers pipeline folder (with {sub}/) or a {what} folder")
        sized = m.size_overrides()
        if m.arch in ("pixart", "sd3") and m.preset != "folder":
            sized = {k: v for k, v in sized.items() if k == "mlp_ratio"}  # their MLPs are 4x wide, fixed
        if sized and m.arch != "dit":
            # Size fields that would do nothing: refused rather than silently ignored.
            key, value = next(iter(sized.items()))
            by = (f"model.preset ({', '.join(ARCH_PRESETS['unet'])})" if m.arch == "unet" else
                  "its preset (hidden, depth, heads and patch_size only) or, with model.preset=folder, "
                  "by the folder in model.init_from")
            raise ConfigError(f"model.{key}={value} sizes the DiT; model.arch={m.arch} is sized by {by}: "
                              f"leave model.{key} unset")
        if m.arch != "dit":
            # Refused here, before any process starts, for the reasons the model's plan gives.
            module = importlib.import_module(f"pipelines.text2image.{m.arch}")
            for dim, reason in module.PARALLEL_LIMITS.items():
                degree = getattr(self.parallel, dim)
                if degree > 1:
                    raise ConfigError(f"parallel.{dim}={degree} is not supported for text2image with "
                                      f"model.arch={m.arch}: {reason}")
