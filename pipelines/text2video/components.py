"""Builds the pieces of a text2video run from its config: VideoDiT, frozen text tower, optional
frozen video VAE, rectified-flow objective, the training loss, the sampler and the MP4/GIF
writers. Shared by train, sample and eval.

Pixel space (vae.path empty): the VideoDiT sees (3, frames, H, W) clips in [-1, 1].
Latent space (vae.path set, pipelines/text2video/vae.py): the loader still decodes PIXEL clips
of model.frames x image_size x image_width (Components.pixel_clip_shape; buckets are pixel
sizes too, Components.clip_tokens converts them to token counts); prepare() encodes them on the
fly (no grad, posterior mean, normalised) and generate() decodes sampled latents back to pixels.
The VideoDiT's config holds the LATENT shape (C, T', H', W').
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from common.config import ConfigError
from common.diffusion import noise as dnoise
from common.diffusion.flow import RectifiedFlow, mse_per_sample
from common.diffusion.samplers import euler_sample
# Reused as is: per-sample seeds from global positions, the run-dir check (sample.py, eval.py).
from pipelines.text2image.components import check_run_dir, sample_seeds  # noqa: F401 (re-export)
from pipelines.text2video.config import T2VConfig
from pipelines.text2video.model import TextEncoder, TextEncoderConfig, VideoDiT, video_dit_config
from pipelines.text2video.vae import VideoVae

PIPELINE = "text2video"


@dataclass
class Components:
    cfg: T2VConfig
    model: VideoDiT
    text_encoder: TextEncoder
    objective: RectifiedFlow
    vae: VideoVae | None = None

    @property
    def num_tokens(self) -> int:
        return self.model.cfg.num_tokens

    @property
    def clip_shape(self) -> tuple[int, int, int, int]:
        """Model-space (C, T, H, W): pixels, or latents with a VAE."""
        c = self.model.cfg
        return c.in_channels, c.frames, c.height, c.width

    @property
    def pixel_clip_shape(self) -> tuple[int, int, int]:
        """(frames, height, width) of the PIXEL clips the loader must decode (= model input without a VAE)."""
        return pixel_clip_shape(self.cfg)

    def model_shape(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """Model-space (T, H, W) of a pixel clip shape; ConfigError if the VAE cannot encode it."""
        return (frames, height, width) if self.vae is None else self.vae.latent_shape(frames, height, width)[1:]

    def clip_tokens(self, shape) -> int:
        """Tokens of a PIXEL clip shape (frames, h, w): the loader's bucket cost (pass as `tokens=`)."""
        return self.model.cfg.tokens(*self.model_shape(*shape))


def pixel_clip_shape(cfg: T2VConfig) -> tuple[int, int, int]:
    m = cfg.model
    return m.frames, m.image_size, m.image_width or m.image_size


def model_overrides(cfg: T2VConfig) -> dict:
    m = cfg.model
    fields = {"patch_size": m.patch_size, "temporal_patch": m.temporal_patch, "hidden": m.hidden, "depth": m.depth,
              "heads": m.heads, "mlp_ratio": m.mlp_ratio}
    out = {k: v for k, v in fields.items() if v}
    out.update(frames=m.frames, height=m.image_size, width=m.image_width or m.image_size, in_channels=m.in_channels,
               attention=m.attention, abs_pos=m.abs_pos)
    return out


def build_objective(cfg: T2VConfig) -> RectifiedFlow:
    d = cfg.diffusion
    return RectifiedFlow(timestep_sampling=d.timesteps, logit_mean=d.logit_mean, logit_std=d.logit_std,
                         shift=d.shift or None, base_shift=d.base_shift, base_tokens=d.base_tokens)


def load_vae(cfg: T2VConfig) -> VideoVae | None:
    """The frozen VAE (None: pixel space), after checking the pixel clip and buckets fit it."""
    if not cfg.vae.path:
        return None
    vae = VideoVae(cfg.vae.path, cfg.vae.kind, cfg.vae.scaling_factor)
    frames, h, w = pixel_clip_shape(cfg)
    try:
        vae.latent_shape(frames, h, w)
    except ConfigError as e:
        raise ConfigError(f"model.frames/image_size/image_width (pixel clip {frames}x{h}x{w}) with vae.path: {e}") from None
    for b in cfg.data.buckets:
        try:
            vae.latent_shape(*(int(v) for v in b))
        except ConfigError as e:
            raise ConfigError(f"data.buckets {list(b)} (pixel sizes) with vae.path: {e}") from None
    m = cfg.model.in_channels
    if m != 3 and m != vae.latent_channels:
        raise ConfigError(f"model.in_channels={m} but the VAE has {vae.latent_channels} latent channels "
                          f"(leave it at 3 or set it to {vae.latent_channels})")
    return vae


def build(cfg: T2VConfig) -> Components:
    # Seeded apart from the global RNG (salts as text2image's), so every rank, resume and
    # sample.py rebuild the same frozen tower and the same initial VideoDiT.
    with torch.random.fork_rng(devices=[]):
        vae = load_vae(cfg)  # inside fork_rng: a diffusers load may draw from the global RNG
        overrides = model_overrides(cfg)
        if vae is not None:  # the VideoDiT works on latents
            c, t, h, w = vae.latent_shape(*pixel_clip_shape(cfg))
            overrides.update(frames=t, height=h, width=w, in_channels=c)
        torch.manual_seed(dnoise.mix_seed(cfg.run.seed, 101))
        text = TextEncoder(TextEncoderConfig(width=cfg.text.width, layers=cfg.text.layers, heads=cfg.text.heads,
                                             context_length=cfg.text.context_length, weights=cfg.text.weights or None,
                                             layer_scale=cfg.text.layer_scale or None))
        torch.manual_seed(dnoise.mix_seed(cfg.run.seed, 102))
        try:
            vcfg = video_dit_config(cfg.model.preset, text_dim=cfg.text.width, text_len=cfg.text.context_length,
                                    **overrides)
        except ValueError as e:
            raise ConfigError(f"model: {e}") from None
        if vcfg.height % vcfg.patch_size or vcfg.width % vcfg.patch_size:
            what = "model.image_size x model.image_width" if vae is None else \
                f"latents of model.image_size x model.image_width / VAE factor {vae.spatial_factor}"
            raise ConfigError(f"frame {vcfg.height}x{vcfg.width} ({what}) is not "
                              f"divisible by model.patch_size={vcfg.patch_size}")
        if vcfg.hidden % vcfg.heads:
            raise ConfigError(f"model.hidden={vcfg.hidden} is not divisible by model.heads={vcfg.heads}")
        try:
            model = VideoDiT(vcfg)
        except ValueError as e:
            raise ConfigError(f"model: {e}") from None
    return Components(cfg, model, text, build_objective(cfg), vae)


def signature(cfg: T2VConfig, comp: Components) -> dict:
    """What must match for a checkpoint to load into this run (checked before any tensor is read)."""
    sig = {"pipeline": PIPELINE, "model": dataclasses.asdict(comp.model.cfg),
           "text": {k: v for k, v in dataclasses.asdict(cfg.text).items() if k != "weights"}}
    if comp.vae is not None:  # the latent space: VAE class, factors, normalisation, latent clip shape
        sig["vae"] = {**comp.vae.describe(), "latent_shape": list(comp.clip_shape)}
    return sig  # (pixel-space runs keep the signature they always had)


def make_step_fns(comp: Components, device):
    """(prepare, criterion) for the Trainer. prepare: captions -> text tokens (with CFG dropout
    seeded per sample), clips (B, C, T, H, W) -> the flow training example, whose shift follows
    the clip's token count (longer or larger clips keep more signal at a given t)."""
    cfg = comp.cfg
    if comp.vae is not None:
        comp.vae.to(device)

    @torch.no_grad()
    def prepare(batch):
        seeds = sample_seeds(cfg.run.seed, batch["__position__"])
        context, mask = comp.text_encoder(dnoise.drop_captions(batch["caption"], seeds, cfg.diffusion.cfg_dropout))
        x0 = batch["video"].to(device)
        if comp.vae is not None:  # pixel clips -> normalised latents (posterior mean: deterministic)
            x0 = comp.vae.encode(x0).to(x0.dtype)
        tokens = comp.model.cfg.tokens(*x0.shape[-3:])
        x_t, t, target = comp.objective.training_example(x0, seeds, num_tokens=tokens)
        return (x_t, t, context.to(device), mask.to(device)), target

    def criterion(pred, target):
        return mse_per_sample(pred, target).mean()

    return prepare, criterion


@torch.no_grad()
def generate(comp: Components, model: VideoDiT, prompts: list[str], seeds: list[int], *, steps: int, guidance: float,
             frames: int | None = None, device=torch.device("cpu"), batch_size: int = 8) -> torch.Tensor:
    """uint8 clips (N, T, H, W, 3) in pixels. Clip i depends only on (prompts[i], seeds[i]).
    frames: PIXEL frames (default model.frames; with a causal VAE 1 + k * its temporal factor)."""
    was_training = model.training
    model.eval()
    c, t_def, h, w = comp.clip_shape
    pf, ph, pw = comp.pixel_clip_shape
    if comp.vae is not None:
        comp.vae.to(device)
        t_lat = comp.vae.latent_frames(frames) if frames else t_def
        pf = comp.vae.pixel_frames(t_lat)
    else:
        t_lat = pf = frames or t_def
    shape_tail = (c, t_lat, h, w)
    tokens = comp.model.cfg.tokens(*shape_tail[1:])
    empty_ctx, empty_mask = comp.text_encoder([""])
    out = []
    for i in range(0, len(prompts), batch_size):
        chunk, chunk_seeds = prompts[i:i + batch_size], seeds[i:i + batch_size]
        ctx, mask = comp.text_encoder(chunk)
        uctx, umask = empty_ctx.expand(len(chunk), -1, -1), empty_mask.expand(len(chunk), -1)
        noise = torch.stack([torch.randn(shape_tail, generator=torch.Generator().manual_seed(int(s))) for s in chunk_seeds])

        def model_fn(x, t, cond):
            return model(x, t, cond[0].to(device), cond[1].to(device))

        x = euler_sample(model_fn, noise.shape, cond=(ctx, mask), uncond=(uctx, umask) if guidance != 1.0 else None,
                         guidance=guidance, num_steps=steps, noise=noise, device=device,
                         shift=comp.objective.shift_for(tokens))
        if comp.vae is not None:
            x = comp.vae.decode(x)  # normalised latents -> pixels (B, 3, T, H, W)
        out.append(to_uint8(x))
    model.train(was_training)
    return torch.cat(out) if out else torch.empty(0, pf, ph, pw, 3, dtype=torch.uint8)


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """(B, C, T, H, W) in [-1, 1] -> uint8 (B, T, H, W, C)."""
    return ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1).cpu()


# --------------------------------------------------------------------------- writers
def _upscale(frames: np.ndarray, scale: int) -> np.ndarray:
    return frames.repeat(scale, axis=1).repeat(scale, axis=2) if scale > 1 else frames


def _even(frames: np.ndarray) -> np.ndarray:
    """yuv420p needs even sides: pad one row/column of white where odd."""
    _, h, w, _ = frames.shape
    return np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), constant_values=255)


def save_mp4(frames, path: str, fps: float, scale: int = 1) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    from data.sources.video import encode_mp4  # the shard writer's encoder: byte-reproducible H.264
    data, _codec = encode_mp4(list(_upscale(np.asarray(frames), scale)), fps, crf=18)
    with open(path, "wb") as f:
        f.write(data)


def save_gif(frames, path: str, fps: float, scale: int = 1) -> None:
    from PIL import Image
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    imgs = [Image.fromarray(f) for f in _upscale(np.asarray(frames), scale)]
    imgs[0].save(path, save_all=True, append_images=imgs[1:], duration=max(1, round(1000 / fps)), loop=0)


def tile(clips: torch.Tensor, cols: int | None = None, border: int = 2) -> np.ndarray:
    """uint8 (N, T, H, W, 3) -> one uint8 (T, H', W', 3) clip with the N clips tiled on a white grid."""
    n, t, h, w, _ = clips.shape
    cols = cols or math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    grid = np.full((t, rows * (h + border) + border, cols * (w + border) + border, 3), 255, dtype=np.uint8)
    arr = clips.numpy()
    for i in range(n):
        r, c = divmod(i, cols)
        y, x = border + r * (h + border), border + c * (w + border)
        grid[:, y:y + h, x:x + w] = arr[i]
    return grid


def save_video_grid(clips: torch.Tensor, stem: str, fps: float, scale: int = 1) -> list[str]:
    """Write stem.mp4 and stem.gif holding all clips tiled spatially; returns the paths."""
    grid = tile(clips)
    save_mp4(grid, stem + ".mp4", fps, scale)
    save_gif(grid, stem + ".gif", fps, scale)
    return [stem + ".mp4", stem + ".gif"]
