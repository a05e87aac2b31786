"""Builds the pieces of a text2image run from its config: the denoiser (DiT, UNet, PixArt or SD3
transformer), frozen text tower, optional VAE,
objective, the training step functions, the sampler and the PNG writers. spec.py hands them to
the shared entrypoints."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import torch
from PIL import Image

from common.config import ConfigError
from common.data.images import save_grid
from common.diffusion import noise as dnoise
from common.diffusion import text_conditioned as tc
from common.hf_folders import weights_variant
from common.nn.text_encoder import build_text_encoder, text_signature
from pipelines.text2image.config import T2IConfig
from pipelines.text2image import pixart, sd3
from pipelines.text2image.model import DiT, dit_config
from pipelines.text2image.unet import (FOLDER_PRESET, UNet, diffusers_config_mismatch, signature_fields,
                                       unet_config, unet_config_from_diffusers)

PIPELINE = "text2image"
# Per-sample stream of the VAE posterior sample (common/diffusion/noise.py uses salts 1-3).
SALT_LATENT = 4


@dataclass
class Components(tc.TextDiffusionComponents):
    latent_channels: int = 3
    latent_size: int = 32

    @property
    def latent_scale(self) -> float:
        return self.cfg.vae.scaling_factor or self.vae.config.scaling_factor

    @property
    def latent_shift(self) -> float:
        """The VAE's shift_factor (SD3's VAE: 0.0609; none in SD 1.x / PixArt's)."""
        return getattr(self.vae.config, "shift_factor", None) or 0.0

    def to_model_space(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE latents -> the model's: (latents - shift) * scale, as diffusers' SD3 pipeline has them."""
        return (latents - self.latent_shift) * self.latent_scale

    def from_model_space(self, x: torch.Tensor) -> torch.Tensor:
        """The model's latents -> the VAE's (what its decoder takes)."""
        return x / self.latent_scale + self.latent_shift

    @property
    def num_tokens(self) -> int:
        return (self.latent_size // self.model.cfg.patch_size) ** 2


def model_overrides(cfg: T2IConfig) -> dict:
    return cfg.model.size_overrides()


def load_vae(cfg: T2IConfig):
    if not cfg.vae.path:
        return None, 3, cfg.model.image_size
    if not os.path.isdir(cfg.vae.path):
        raise ConfigError(f"vae.path={cfg.vae.path!r} is not a directory (a diffusers AutoencoderKL folder)")
    from diffusers import AutoencoderKL
    vae = AutoencoderKL.from_pretrained(cfg.vae.path, local_files_only=True, low_cpu_mem_usage=False,
                                        variant=weights_variant(cfg.vae.path), torch_dtype=torch.float32)
    vae = vae.eval().requires_grad_(False)
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    if cfg.model.image_size % factor:
        raise ConfigError(f"model.image_size={cfg.model.image_size} is not divisible by the VAE's downsampling factor {factor}")
    return vae, vae.config.latent_channels, cfg.model.image_size // factor


def build_dit(cfg: T2IConfig, size: int, channels: int) -> DiT:
    dcfg = dit_config(cfg.model.preset, img_size=size, in_channels=channels, text_dim=cfg.text.width, text_len=cfg.text.context_length,
                      **model_overrides(cfg))
    if size % dcfg.patch_size:
        raise ConfigError(f"model input size {size} is not divisible by model.patch_size={dcfg.patch_size}")
    if dcfg.hidden % dcfg.heads:
        raise ConfigError(f"model.hidden={dcfg.hidden} is not divisible by model.heads={dcfg.heads}")
    return DiT(dcfg)


def denoiser_folder(path: str, class_name: str = "UNet2DConditionModel", sub: str = "unet") -> str | None:
    """The diffusers `class_name` folder in `path`: its `sub`/ (a pipeline folder, e.g. Stable
    Diffusion's unet/ or PixArt's transformer/) or `path` itself (a bare model folder); None when it
    holds neither."""
    for folder in (os.path.join(path, sub), path):
        config = os.path.join(folder, "config.json")
        if os.path.isfile(config):
            with open(config) as f:
                if json.load(f).get("_class_name") == class_name:
                    return folder
    return None


def unet_folder(path: str) -> str | None:
    """The diffusers UNet2DConditionModel folder in `path` (its unet/, or itself)."""
    return denoiser_folder(path)


def pixart_folder(path: str) -> str | None:
    """The diffusers PixArtTransformer2DModel folder in `path` (its transformer/, or itself)."""
    return denoiser_folder(path, pixart.CLASS_NAME, "transformer")


def sd3_folder(path: str) -> str | None:
    """The diffusers SD3Transformer2DModel folder in `path` (its transformer/, or itself)."""
    return denoiser_folder(path, sd3.CLASS_NAME, "transformer")


def read_folder_config(path: str, class_name: str = "UNet2DConditionModel", sub: str = "unet") -> dict:
    folder = denoiser_folder(path, class_name, sub) if os.path.isdir(path) else None
    if folder is None:
        raise ConfigError(f"model.preset={FOLDER_PRESET} takes the architecture of the diffusers model in "
                          f"model.init_from, but {path!r} holds no {class_name} (a {sub}/config.json, or a config.json)")
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def build_transformer(cfg: T2IConfig, sizes: dict, what: str, module, make_config, config_from_folder, model_cls):
    """A diffusers-backed transformer (pixart.py, sd3.py): from its preset and the size fields, or
    with model.preset=folder exactly as the folder in model.init_from says (refused, naming the
    setting, where the run cannot drive it or the build differs from the folder's config)."""
    if cfg.model.preset == FOLDER_PRESET:
        folder_config = read_folder_config(cfg.model.init_from, module.CLASS_NAME, "transformer")
        try:
            mcfg = config_from_folder(folder_config, **sizes)
        except ValueError as e:
            raise ConfigError(f"model.init_from={cfg.model.init_from}: its {what} transformer cannot be trained "
                              f"here: {e}") from None
    else:
        mcfg = make_config(cfg.model.preset, **sizes, **model_overrides(cfg))
    if sizes["img_size"] % mcfg.patch_size:
        raise ConfigError(f"model input size {sizes['img_size']} is not divisible by the {what} patch size "
                          f"{mcfg.patch_size}")
    if mcfg.hidden % mcfg.heads:
        raise ConfigError(f"model.hidden={mcfg.hidden} is not divisible by model.heads={mcfg.heads}")
    model = model_cls(mcfg)
    if cfg.model.preset == FOLDER_PRESET:
        wrong = module.diffusers_config_mismatch(model.transformer, folder_config)
        if wrong:  # a setting the mapping above lost: refuse rather than train a different network
            raise ConfigError(f"model.init_from={cfg.model.init_from}: the {what} transformer built differs from "
                              f"the folder's: {'; '.join(wrong[:4])}")
    return model


def build_pixart(cfg: T2IConfig, size: int, channels: int) -> pixart.PixArt:
    sizes = dict(img_size=size, in_channels=channels, text_dim=cfg.text.width, text_len=cfg.text.context_length,
                 image_size=cfg.model.image_size)
    return build_transformer(cfg, sizes, "PixArt", pixart, pixart.pixart_config, pixart.pixart_config_from_diffusers,
                             pixart.PixArt)


def build_sd3(cfg: T2IConfig, size: int, channels: int, text) -> sd3.SD3:
    # SD3's own text stack (common.nn.text_encoder.SD3TextEncoders) hands over its pooled vector in
    # the caption's first row; any other tower's pooled vector is the mean of its tokens.
    sizes = dict(img_size=size, in_channels=channels, text_dim=cfg.text.width,
                 pooled_dim=getattr(text, "pooled_width", 0),
                 text_len=getattr(text, "num_positions", cfg.text.context_length))
    return build_transformer(cfg, sizes, "SD3", sd3, sd3.sd3_config, sd3.sd3_config_from_diffusers, sd3.SD3)


def build_unet(cfg: T2IConfig, size: int, channels: int) -> UNet:
    sizes = dict(img_size=size, in_channels=channels, text_dim=cfg.text.width, text_len=cfg.text.context_length)
    if cfg.model.preset == FOLDER_PRESET:
        folder_config = read_folder_config(cfg.model.init_from)
        try:
            ucfg = unet_config_from_diffusers(folder_config, **sizes)
        except ValueError as e:
            raise ConfigError(f"model.init_from={cfg.model.init_from}: its UNet cannot be trained here: {e}") from None
    else:
        ucfg = unet_config(cfg.model.preset, **sizes)
    if size % ucfg.downsample:
        raise ConfigError(f"model input size {size} is not divisible by {ucfg.downsample}, the downsampling factor "
                          f"of the {cfg.model.preset} UNet")
    model = UNet(ucfg)
    if cfg.model.preset == FOLDER_PRESET:
        wrong = diffusers_config_mismatch(model.unet, folder_config)
        if wrong:  # a setting the mapping above lost: refuse rather than train a different network
            raise ConfigError(f"model.init_from={cfg.model.init_from}: the UNet built differs from the folder's: "
                              f"{'; '.join(wrong[:4])}")
    return model


def build(cfg: T2IConfig) -> Components:
    vae, channels, size = load_vae(cfg)
    # Frozen tower and DiT (or UNet) seeded apart from the global RNG, so that every rank, every resume and
    # sample.py rebuild exactly the same tower (a random one is also saved in checkpoints) and initial DiT.
    text = build_text_encoder(cfg.text, cfg.run.seed, sd3_stack=cfg.model.arch == "sd3")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(dnoise.mix_seed(cfg.run.seed, 102))
        if cfg.model.arch == "sd3":
            model = build_sd3(cfg, size, channels, text)
        else:
            build_model = {"unet": build_unet, "pixart": build_pixart}.get(cfg.model.arch, build_dit)
            model = build_model(cfg, size, channels)
    return Components(cfg, model, text, tc.objective_from_config(cfg.diffusion), vae, channels, size)


def signature(cfg: T2IConfig, comp: Components) -> dict:
    """What must match for a checkpoint to load into this run (checked before any tensor is read)."""
    if isinstance(comp.model, UNet):
        model = signature_fields(comp.model.cfg)
    elif isinstance(comp.model, pixart.PixArt):
        model = pixart.signature_fields(comp.model.cfg)
    elif isinstance(comp.model, sd3.SD3):
        model = sd3.signature_fields(comp.model.cfg)
    else:
        model = dataclasses.asdict(comp.model.cfg)
    return {"pipeline": PIPELINE, "model": model,
            "text": text_signature(cfg.text),
            "latent": [comp.latent_channels, comp.latent_size]}


@torch.no_grad()
def encode_images(comp: Components, batch: dict, device) -> torch.Tensor:
    """Model-space inputs: precomputed latents, VAE latents on the fly, or pixels in [-1, 1].
    Precomputed `latent.npy` holds unscaled VAE latents (as the VAE outputs them); the VAE's shift
    and scale are applied here so that changing vae.scaling_factor needs no new shards."""
    if comp.vae is None:
        return batch["image"].to(device)
    if "latent" in batch:
        return comp.to_model_space(batch["latent"].to(device))
    posterior = comp.vae.encode(batch["image"].to(device)).latent_dist
    # The posterior sample's noise comes from each sample's own seed (as the diffusion noise does),
    # not from the global RNG, which is seeded per rank: the same sample gets the same latent under
    # any layout, DP degree and resume.
    seeds = dnoise.sample_seeds(comp.cfg.run.seed, batch["__position__"])
    eps = dnoise.per_sample_randn(seeds, posterior.mean.shape[1:], SALT_LATENT, device=posterior.mean.device,
                                  dtype=posterior.mean.dtype)
    return comp.to_model_space(posterior.mean + posterior.std * eps)


def make_step_fns(comp: Components, device):
    """(prepare, criterion) for the Trainer (common.diffusion.text_conditioned)."""
    return tc.diffusion_step_fns(encode=lambda batch: encode_images(comp, batch, device),
                                 tokens_of=lambda x0: comp.num_tokens, text_encoder=comp.text_encoder,
                                 objective=comp.objective, run_seed=comp.cfg.run.seed,
                                 cfg_dropout=comp.cfg.diffusion.cfg_dropout, device=device)


@torch.no_grad()
def generate(comp: Components, model: DiT, prompts: list[str], seeds: list[int], *, steps: int, guidance: float,
             device=torch.device("cpu"), batch_size: int = 32) -> torch.Tensor:
    """uint8 images (N, H, W, 3). Image i depends only on (prompts[i], seeds[i])."""
    decode = (lambda x: comp.vae.decode(comp.from_model_space(x)).sample) if comp.vae is not None else None
    out = tc.generate(model, comp.text_encoder, comp.objective, prompts, seeds,
                      shape=(comp.latent_channels, comp.latent_size, comp.latent_size), num_tokens=comp.num_tokens,
                      steps=steps, guidance=guidance, device=device, batch_size=batch_size, decode=decode)
    size = comp.cfg.model.image_size
    return torch.cat([tc.to_uint8(x) for x in out]) if out else torch.empty(0, size, size, 3, dtype=torch.uint8)


def flops(comp: Components, inputs: tuple) -> float:
    """Forward FLOPs of a prepared micro-batch (one resolution: the batch size varies only)."""
    return comp.model.flops_per_sample() * len(inputs[0])


def write_grid(images: torch.Tensor, stem: str, comp: Components, options: dict) -> list[str]:
    save_grid(images, stem + ".png", scale=4)
    return [stem + ".png"]


def write_image(image: torch.Tensor, stem: str, comp: Components, options: dict) -> tuple[dict, dict]:
    Image.fromarray(image.numpy()).save(stem + ".png")
    return {"file": os.path.basename(stem) + ".png"}, {}
