"""Builds the pieces of a text2video run from its config: VideoDiT, frozen text tower, optional
frozen video VAE, rectified-flow objective, the training loss, the sampler and the MP4/GIF
writers. spec.py hands them to the shared entrypoints.

Pixel space (vae.path empty): the VideoDiT sees (3, frames, H, W) clips in [-1, 1].
Latent space (vae.path set, pipelines/text2video/vae.py): the loader still decodes PIXEL clips
of model.frames x image_size x image_width (Components.pixel_clip_shape; buckets are pixel
sizes too, Components.clip_tokens converts them to token counts); prepare() encodes them on the
fly (no grad, posterior mean, normalised) and generate() decodes sampled latents back to pixels.
The VideoDiT's config holds the LATENT shape (C, T', H', W').
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np
import torch

from common.config import ConfigError
from common.data.images import tile
from common.data.media import encode_mp4
from common.diffusion import noise as dnoise
from common.diffusion import text_conditioned as tc
from common.nn.text_encoder import build_text_encoder, text_signature
from pipelines.text2video.config import T2VConfig
from pipelines.text2video.model import VideoDiT, video_dit_config
from pipelines.text2video.vae import VideoVae

PIPELINE = "text2video"


@dataclass
class Components(tc.TextDiffusionComponents):

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
    out = m.size_overrides() | ({"temporal_patch": m.temporal_patch} if m.temporal_patch else {})
    out.update(frames=m.frames, height=m.image_size, width=m.image_width or m.image_size, in_channels=m.in_channels,
               attention=m.attention, abs_pos=m.abs_pos)
    return out


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
        text = build_text_encoder(cfg.text, cfg.run.seed)
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
    return Components(cfg, model, text, tc.objective_from_config(cfg.diffusion), vae)


def signature(cfg: T2VConfig, comp: Components) -> dict:
    """What must match for a checkpoint to load into this run (checked before any tensor is read)."""
    sig = {"pipeline": PIPELINE, "model": dataclasses.asdict(comp.model.cfg),
           "text": text_signature(cfg.text)}
    if comp.vae is not None:  # the latent space: VAE class, factors, normalisation, latent clip shape
        sig["vae"] = {**comp.vae.describe(), "latent_shape": list(comp.clip_shape)}
    return sig  # (pixel-space runs keep the signature they always had)


def make_step_fns(comp: Components, device):
    """(prepare, criterion) for the Trainer (common.diffusion.text_conditioned): clips (B, C, T, H, W),
    encoded to normalised latents with a VAE (posterior mean: deterministic), become flow training
    examples whose shift follows the clip's token count (longer or larger clips keep more signal at
    a given t). Expects the components on `device` already (comp.to(device))."""

    def encode(batch):
        x0 = batch["video"].to(device)
        return x0 if comp.vae is None else comp.vae.encode(x0).to(x0.dtype)

    return tc.diffusion_step_fns(encode=encode, tokens_of=lambda x0: comp.model.cfg.tokens(*x0.shape[-3:]),
                                 text_encoder=comp.text_encoder, objective=comp.objective,
                                 run_seed=comp.cfg.run.seed, cfg_dropout=comp.cfg.diffusion.cfg_dropout, device=device)


@torch.no_grad()
def generate(comp: Components, model: VideoDiT, prompts: list[str], seeds: list[int], *, steps: int, guidance: float,
             frames: int | None = None, device=torch.device("cpu"), batch_size: int = 8) -> torch.Tensor:
    """uint8 clips (N, T, H, W, 3) in pixels. Clip i depends only on (prompts[i], seeds[i]).
    frames: PIXEL frames (default model.frames; with a causal VAE 1 + k * its temporal factor)."""
    c, t_def, h, w = comp.clip_shape
    pf, ph, pw = comp.pixel_clip_shape
    if comp.vae is not None:
        comp.vae.to(device)
        t_lat = comp.vae.latent_frames(frames) if frames else t_def
        pf = comp.vae.pixel_frames(t_lat)
    else:
        t_lat = pf = frames or t_def
    out = tc.generate(model, comp.text_encoder, comp.objective, prompts, seeds, shape=(c, t_lat, h, w),
                      num_tokens=comp.model.cfg.tokens(t_lat, h, w), steps=steps, guidance=guidance, device=device,
                      batch_size=batch_size, decode=comp.vae.decode if comp.vae is not None else None)
    return torch.cat([tc.to_uint8(x) for x in out]) if out else torch.empty(0, pf, ph, pw, 3, dtype=torch.uint8)


def flops(comp: Components, inputs: tuple) -> float:
    """Forward FLOPs of a prepared micro-batch at its own model-space clip shape (buckets vary it)."""
    x_t = inputs[0]
    return comp.model.flops_per_sample(*x_t.shape[-3:]) * len(x_t)


# --------------------------------------------------------------------------- writers
def _upscale(frames: np.ndarray, scale: int) -> np.ndarray:
    return frames.repeat(scale, axis=1).repeat(scale, axis=2) if scale > 1 else frames


def _even(frames: np.ndarray) -> np.ndarray:
    """yuv420p needs even sides: pad one row/column of white where odd."""
    _, h, w, _ = frames.shape
    return np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), constant_values=255)


def save_mp4(frames, path: str, fps: float, scale: int = 1) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    data, _codec = encode_mp4(list(_even(_upscale(np.asarray(frames), scale))), fps, crf=18)
    with open(path, "wb") as f:
        f.write(data)


def save_gif(frames, path: str, fps: float, scale: int = 1) -> None:
    from PIL import Image
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    imgs = [Image.fromarray(f) for f in _upscale(np.asarray(frames), scale)]
    imgs[0].save(path, save_all=True, append_images=imgs[1:], duration=max(1, round(1000 / fps)), loop=0)


def save_video_grid(clips: torch.Tensor, stem: str, fps: float, scale: int = 1) -> list[str]:
    """Write stem.mp4 and stem.gif holding all clips tiled spatially; returns the paths."""
    grid = tile(clips)
    save_mp4(grid, stem + ".mp4", fps, scale)
    save_gif(grid, stem + ".gif", fps, scale)
    return [stem + ".mp4", stem + ".gif"]


def write_grid(clips: torch.Tensor, stem: str, comp: Components, options: dict) -> list[str]:
    return save_video_grid(clips, stem, options.get("fps") or comp.cfg.sample.fps,
                           options.get("scale") or comp.cfg.sample.scale)


def write_clip(clip: torch.Tensor, stem: str, comp: Components, options: dict) -> tuple[dict, dict]:
    """One MP4 and one GIF; the index records the clip's frame count."""
    fps, scale = options.get("fps") or comp.cfg.sample.fps, options.get("scale") or comp.cfg.sample.scale
    save_mp4(clip.numpy(), stem + ".mp4", fps, scale)
    save_gif(clip.numpy(), stem + ".gif", fps, scale)
    name = os.path.basename(stem)
    return {"file": name + ".mp4", "gif": name + ".gif"}, {"frames": int(clip.shape[0])}
