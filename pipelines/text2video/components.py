"""Builds the pieces of a text2video run from its config: VideoDiT, frozen text tower,
rectified-flow objective, the training loss, the sampler and the MP4/GIF writers. Shared by
train, sample and eval. Pixel space only (a video VAE is not wired in yet)."""
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

PIPELINE = "text2video"


@dataclass
class Components:
    cfg: T2VConfig
    model: VideoDiT
    text_encoder: TextEncoder
    objective: RectifiedFlow

    @property
    def num_tokens(self) -> int:
        return self.model.cfg.num_tokens

    @property
    def clip_shape(self) -> tuple[int, int, int, int]:
        c = self.model.cfg
        return c.in_channels, c.frames, c.height, c.width


def model_overrides(cfg: T2VConfig) -> dict:
    m = cfg.model
    fields = {"patch_size": m.patch_size, "temporal_patch": m.temporal_patch, "hidden": m.hidden, "depth": m.depth,
              "heads": m.heads, "mlp_ratio": m.mlp_ratio}
    out = {k: v for k, v in fields.items() if v}
    out.update(frames=m.frames, height=m.image_size, width=m.image_width or m.image_size, in_channels=m.in_channels,
               attention=m.attention)
    return out


def build_objective(cfg: T2VConfig) -> RectifiedFlow:
    d = cfg.diffusion
    return RectifiedFlow(timestep_sampling=d.timesteps, logit_mean=d.logit_mean, logit_std=d.logit_std,
                         shift=d.shift or None, base_shift=d.base_shift, base_tokens=d.base_tokens)


def build(cfg: T2VConfig) -> Components:
    # Seeded apart from the global RNG (salts as text2image's), so every rank, resume and
    # sample.py rebuild the same frozen tower and the same initial VideoDiT.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(dnoise.mix_seed(cfg.run.seed, 101))
        text = TextEncoder(TextEncoderConfig(width=cfg.text.width, layers=cfg.text.layers, heads=cfg.text.heads,
                                             context_length=cfg.text.context_length, weights=cfg.text.weights or None,
                                             layer_scale=cfg.text.layer_scale or None))
        torch.manual_seed(dnoise.mix_seed(cfg.run.seed, 102))
        try:
            vcfg = video_dit_config(cfg.model.preset, text_dim=cfg.text.width, text_len=cfg.text.context_length,
                                    **model_overrides(cfg))
        except ValueError as e:
            raise ConfigError(f"model: {e}") from None
        if vcfg.height % vcfg.patch_size or vcfg.width % vcfg.patch_size:
            raise ConfigError(f"frame {vcfg.height}x{vcfg.width} (model.image_size x model.image_width) is not "
                              f"divisible by model.patch_size={vcfg.patch_size}")
        if vcfg.hidden % vcfg.heads:
            raise ConfigError(f"model.hidden={vcfg.hidden} is not divisible by model.heads={vcfg.heads}")
        try:
            model = VideoDiT(vcfg)
        except ValueError as e:
            raise ConfigError(f"model: {e}") from None
    return Components(cfg, model, text, build_objective(cfg))


def signature(cfg: T2VConfig, comp: Components) -> dict:
    """What must match for a checkpoint to load into this run (checked before any tensor is read)."""
    return {"pipeline": PIPELINE, "model": dataclasses.asdict(comp.model.cfg),
            "text": {k: v for k, v in dataclasses.asdict(cfg.text).items() if k != "weights"}}


def make_step_fns(comp: Components, device):
    """(prepare, criterion) for the Trainer. prepare: captions -> text tokens (with CFG dropout
    seeded per sample), clips (B, C, T, H, W) -> the flow training example, whose shift follows
    the clip's token count (longer or larger clips keep more signal at a given t)."""
    cfg = comp.cfg

    @torch.no_grad()
    def prepare(batch):
        seeds = sample_seeds(cfg.run.seed, batch["__position__"])
        context, mask = comp.text_encoder(dnoise.drop_captions(batch["caption"], seeds, cfg.diffusion.cfg_dropout))
        x0 = batch["video"].to(device)
        tokens = comp.model.cfg.tokens(*x0.shape[-3:])
        x_t, t, target = comp.objective.training_example(x0, seeds, num_tokens=tokens)
        return (x_t, t, context.to(device), mask.to(device)), target

    def criterion(pred, target):
        return mse_per_sample(pred, target).mean()

    return prepare, criterion


@torch.no_grad()
def generate(comp: Components, model: VideoDiT, prompts: list[str], seeds: list[int], *, steps: int, guidance: float,
             frames: int | None = None, device=torch.device("cpu"), batch_size: int = 8) -> torch.Tensor:
    """uint8 clips (N, T, H, W, 3). Clip i depends only on (prompts[i], seeds[i])."""
    was_training = model.training
    model.eval()
    c, t_def, h, w = comp.clip_shape
    shape_tail = (c, frames or t_def, h, w)
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
        out.append(to_uint8(x))
    model.train(was_training)
    return torch.cat(out) if out else torch.empty(0, shape_tail[1], h, w, 3, dtype=torch.uint8)


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
