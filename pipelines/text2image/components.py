"""Builds the pieces of a text2image run from its config: DiT, frozen text tower, optional VAE,
objective, the training loss and the sampler. Shared by train, sample and eval."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from common.checkpoint import CheckpointError
from common.config import ConfigError
from common.diffusion import noise as dnoise
from common.diffusion.ddpm import DDPM
from common.diffusion.flow import RectifiedFlow, mse_per_sample
from common.diffusion.samplers import ddim_sample, euler_sample
from pipelines.text2image.config import T2IConfig
from pipelines.text2image.model import DiT, TextEncoder, TextEncoderConfig, dit_config

PIPELINE = "text2image"


@dataclass
class Components:
    cfg: T2IConfig
    model: DiT
    text_encoder: TextEncoder
    vae: torch.nn.Module | None
    objective: RectifiedFlow | DDPM
    latent_channels: int
    latent_size: int

    @property
    def latent_scale(self) -> float:
        return self.cfg.vae.scaling_factor or self.vae.config.scaling_factor

    @property
    def num_tokens(self) -> int:
        return (self.latent_size // self.model.cfg.patch_size) ** 2


def model_overrides(cfg: T2IConfig) -> dict:
    m = cfg.model
    fields = {"patch_size": m.patch_size, "hidden": m.hidden, "depth": m.depth, "heads": m.heads, "mlp_ratio": m.mlp_ratio}
    return {k: v for k, v in fields.items() if v}


def load_vae(cfg: T2IConfig):
    if not cfg.vae.path:
        return None, 3, cfg.model.image_size
    if not os.path.isdir(cfg.vae.path):
        raise ConfigError(f"vae.path={cfg.vae.path!r} is not a directory (a diffusers AutoencoderKL folder)")
    from diffusers import AutoencoderKL
    vae = AutoencoderKL.from_pretrained(cfg.vae.path).eval().requires_grad_(False)
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    if cfg.model.image_size % factor:
        raise ConfigError(f"model.image_size={cfg.model.image_size} is not divisible by the VAE's downsampling factor {factor}")
    return vae, vae.config.latent_channels, cfg.model.image_size // factor


def build_objective(cfg: T2IConfig):
    d = cfg.diffusion
    if d.objective == "flow":
        return RectifiedFlow(timestep_sampling=d.timesteps, logit_mean=d.logit_mean, logit_std=d.logit_std,
                             shift=d.shift or None, base_shift=d.base_shift, base_tokens=d.base_tokens)
    return DDPM(schedule=d.ddpm_schedule, prediction=d.ddpm_prediction)


def build(cfg: T2IConfig) -> Components:
    vae, channels, size = load_vae(cfg)
    # Frozen random text tower: seeded independently of the global RNG so that every rank, every
    # resume and sample.py rebuild exactly the same tower (it is also saved in checkpoints).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(dnoise.mix_seed(cfg.run.seed, 101))
        text = TextEncoder(TextEncoderConfig(width=cfg.text.width, layers=cfg.text.layers, heads=cfg.text.heads,
                                             context_length=cfg.text.context_length, weights=cfg.text.weights or None,
                                             layer_scale=cfg.text.layer_scale or None))
        torch.manual_seed(dnoise.mix_seed(cfg.run.seed, 102))
        dcfg = dit_config(cfg.model.preset, img_size=size, in_channels=channels, text_dim=cfg.text.width, text_len=cfg.text.context_length,
                          **model_overrides(cfg))
        if size % dcfg.patch_size:
            raise ConfigError(f"model input size {size} is not divisible by model.patch_size={dcfg.patch_size}")
        if dcfg.hidden % dcfg.heads:
            raise ConfigError(f"model.hidden={dcfg.hidden} is not divisible by model.heads={dcfg.heads}")
        model = DiT(dcfg)
    return Components(cfg, model, text, vae, build_objective(cfg), channels, size)


def signature(cfg: T2IConfig, comp: Components) -> dict:
    """What must match for a checkpoint to load into this run (checked before any tensor is read)."""
    return {"pipeline": PIPELINE, "model": dataclasses.asdict(comp.model.cfg),
            "text": {k: v for k, v in dataclasses.asdict(cfg.text).items() if k != "weights"},
            "latent": [comp.latent_channels, comp.latent_size]}


@torch.no_grad()
def encode_images(comp: Components, batch: dict, device) -> torch.Tensor:
    """Model-space inputs: precomputed latents, VAE latents on the fly, or pixels in [-1, 1].
    Precomputed `latent.npy` holds unscaled VAE latents (as the VAE outputs them); the scale is
    applied here so that changing vae.scaling_factor needs no new shards."""
    if comp.vae is None:
        return batch["image"].to(device)
    if "latent" in batch:
        return batch["latent"].to(device) * comp.latent_scale
    return comp.vae.encode(batch["image"].to(device)).latent_dist.sample() * comp.latent_scale


def sample_seeds(run_seed: int, positions: torch.Tensor) -> torch.Tensor:
    """Per-sample seeds from global sample positions: identical under any parallel layout."""
    return positions.long() + int(run_seed) * (1 << 40)


def make_step_fns(comp: Components, device):
    """(prepare, criterion) for the Trainer. prepare holds everything without trainable weights
    (text tower, VAE, timesteps, noise) and returns the DiT's inputs and the regression target."""
    cfg = comp.cfg

    @torch.no_grad()
    def prepare(batch):
        seeds = sample_seeds(cfg.run.seed, batch["__position__"])
        context, mask = comp.text_encoder(dnoise.drop_captions(batch["caption"], seeds, cfg.diffusion.cfg_dropout))
        x0 = encode_images(comp, batch, device)
        if isinstance(comp.objective, RectifiedFlow):
            x_t, t, target = comp.objective.training_example(x0, seeds, num_tokens=comp.num_tokens)
        else:
            x_t, t, target = comp.objective.training_example(x0, seeds)
        return (x_t, t, context.to(device), mask.to(device)), target

    def criterion(pred, target):
        return mse_per_sample(pred, target).mean()

    return prepare, criterion


@torch.no_grad()
def generate(comp: Components, model: DiT, prompts: list[str], seeds: list[int], *, steps: int, guidance: float,
             device=torch.device("cpu"), batch_size: int = 32) -> torch.Tensor:
    """uint8 images (N, H, W, 3). Image i depends only on (prompts[i], seeds[i])."""
    was_training = model.training
    model.eval()
    out = []
    shape_tail = (comp.latent_channels, comp.latent_size, comp.latent_size)
    empty_ctx, empty_mask = comp.text_encoder([""])  # the unconditional caption, encoded once
    for i in range(0, len(prompts), batch_size):
        chunk, chunk_seeds = prompts[i:i + batch_size], seeds[i:i + batch_size]
        ctx, mask = comp.text_encoder(chunk)
        uctx, umask = empty_ctx.expand(len(chunk), -1, -1), empty_mask.expand(len(chunk), -1)
        noise = torch.stack([torch.randn(shape_tail, generator=torch.Generator().manual_seed(int(s))) for s in chunk_seeds])

        def model_fn(x, t, c):
            return model(x, t, c[0].to(device), c[1].to(device))

        kwargs = dict(cond=(ctx, mask), uncond=(uctx, umask) if guidance != 1.0 else None, guidance=guidance,
                      num_steps=steps, noise=noise, device=device)
        if isinstance(comp.objective, RectifiedFlow):
            x = euler_sample(model_fn, noise.shape, shift=comp.objective.shift_for(comp.num_tokens), **kwargs)
        else:
            x = ddim_sample(model_fn, comp.objective, noise.shape, **kwargs)
        if comp.vae is not None:
            x = comp.vae.decode(x / comp.latent_scale).sample
        out.append(((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu())
    model.train(was_training)
    return torch.cat(out) if out else torch.empty(0, comp.cfg.model.image_size, comp.cfg.model.image_size, 3, dtype=torch.uint8)


def save_grid(images: torch.Tensor, path: str, cols: int | None = None, scale: int = 1) -> None:
    """Tile uint8 (N, H, W, 3) images into one PNG, upscaled by `scale` (nearest) for viewing."""
    import math
    from PIL import Image
    n, h, w, _ = images.shape
    cols = cols or math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    grid = torch.zeros(rows * (h + 2) + 2, cols * (w + 2) + 2, 3, dtype=torch.uint8) + 255
    for i in range(n):
        r, c = divmod(i, cols)
        grid[2 + r * (h + 2): 2 + r * (h + 2) + h, 2 + c * (w + 2): 2 + c * (w + 2) + w] = images[i]
    img = Image.fromarray(grid.numpy())
    if scale > 1:
        img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    img.save(path)


def check_run_dir(run_dir: str) -> str:
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        raise CheckpointError(f"{run_dir} is not a run directory (no config.yaml)")
    return path
