"""A frozen diffusers video VAE for latent-space text2video, loaded from a local folder.

Supported (vae.kind, or read from the folder's config.json `_class_name` with kind=auto):
  wan        AutoencoderKLWan        causal 3-D VAE (Wan 2.1: 4x time, 8x space, 16 ch)
  cogvideox  AutoencoderKLCogVideoX  causal 3-D VAE (4x time, 8x space, 16 ch)
  image      AutoencoderKL           an image VAE applied frame by frame (time folded into the batch)

Frame-count rule. A causal video VAE encodes the first frame alone and every further `tf`
frames into one latent frame: T = 1 + k*tf pixel frames <-> 1 + k latent frames (T = 1, an
image, is one latent frame). Other counts are refused (the diffusers encoders would silently
drop or mis-chunk frames). CogVideoX's decoder further needs an odd latent count (T = 1 + 8m
for 4x time, e.g. 49 -> 13): it decodes an even count to the wrong length. The image VAE keeps T.

Normalisation (model-space latents = (raw - shift) * scale, per channel where the VAE has
per-channel statistics; decode inverts it exactly):
  wan        shift = config.latents_mean, scale = 1 / config.latents_std (as diffusers' Wan pipeline)
  cogvideox  shift = config.shift_factor or 0, scale = config.scaling_factor
  image      shift = config.shift_factor or 0, scale = config.scaling_factor
  vae.scaling_factor > 0 replaces the scale by that scalar (the shift is kept).

Encoding uses the posterior mean (latent_dist.mode()), not a sample: the training example is then
a deterministic function of the clip, the run seed and the sample position (the flow noise is
seeded per sample in components.make_step_fns), so resumes and parallel layouts reproduce it.
"""
from __future__ import annotations

import json
import os

import torch

from common.config import ConfigError
from common.hf_folders import weights_variant

CLASSES = {"AutoencoderKLWan": "wan", "AutoencoderKLCogVideoX": "cogvideox", "AutoencoderKL": "image"}
KINDS = ("auto", "wan", "cogvideox", "image")


def detect_kind(path: str) -> str:
    """The kind named by the folder's config.json `_class_name`."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"vae.path={path!r} has no config.json (expected a diffusers VAE folder, "
                          f"as written by save_pretrained)")
    with open(cfg_path) as f:
        name = json.load(f).get("_class_name")
    if name not in CLASSES:
        raise ConfigError(f"vae.path={path!r}: unsupported VAE class {name!r} (supported: {', '.join(CLASSES)}; "
                          f"or set vae.kind)")
    return CLASSES[name]


class VideoVae:
    """Frozen (eval, no grad) wrapper: encode (B, 3, T, H, W) in [-1, 1] -> normalised latents
    (B, C, T', H', W'); decode back. Not an nn.Module on purpose: it is not trained, not wrapped
    by FSDP and not saved in checkpoints (the run's vae.path names it; signature() records its
    class, scale and latent shape)."""

    def __init__(self, path: str, kind: str = "auto", scaling_factor: float = 0.0):
        if not path or not os.path.isdir(path):
            raise ConfigError(f"vae.path={path!r} is not a directory (a local diffusers video VAE folder)")
        if kind not in KINDS:
            raise ConfigError(f"vae.kind={kind!r} is not one of {', '.join(KINDS)}")
        self.path = path
        self.kind = detect_kind(path) if kind == "auto" else kind
        import diffusers
        cls = getattr(diffusers, {v: k for k, v in CLASSES.items()}[self.kind])
        try:
            self.vae = cls.from_pretrained(path, local_files_only=True, low_cpu_mem_usage=False,
                                           variant=weights_variant(path), torch_dtype=torch.float32)
            self.vae = self.vae.eval().requires_grad_(False)
        except Exception as e:  # a folder of another class, missing weights, ...
            raise ConfigError(f"vae.path={path!r}: cannot load it as {cls.__name__} ({type(e).__name__}: {e})") from None
        c = self.vae.config
        if self.kind == "wan":
            self._spatial, self._temporal, self._channels = int(c.scale_factor_spatial), int(c.scale_factor_temporal), int(c.z_dim)
            # Cross-check the config's factors against the architecture (the encoder chunks frames by 4).
            arch_s = 2 ** (len(c.dim_mult) - 1) * (c.patch_size or 1)
            arch_t = 2 ** sum(bool(d) for d in c.temperal_downsample)
            if (arch_s, arch_t) != (self._spatial, self._temporal) or self._temporal != 4:
                raise ConfigError(f"vae.path={path!r}: AutoencoderKLWan config says scale_factor_spatial="
                                  f"{self._spatial}, scale_factor_temporal={self._temporal} but its blocks give "
                                  f"{arch_s}x space, {arch_t}x time (its encoder needs 4x time)")
            shift = torch.tensor(c.latents_mean, dtype=torch.float32)
            scale = 1.0 / torch.tensor(c.latents_std, dtype=torch.float32)
            if shift.numel() != self._channels or scale.numel() != self._channels:
                raise ConfigError(f"vae.path={path!r}: latents_mean/latents_std have {shift.numel()}/{scale.numel()} "
                                  f"entries for z_dim={self._channels}")
        else:
            self._spatial = 2 ** (len(c.block_out_channels) - 1)
            self._temporal = int(c.temporal_compression_ratio) if self.kind == "cogvideox" else 1
            self._channels = int(c.latent_channels)
            shift = torch.full((self._channels,), float(getattr(c, "shift_factor", None) or 0.0))
            scale = torch.full((self._channels,), float(c.scaling_factor))
        if scaling_factor > 0:
            scale = torch.full((self._channels,), float(scaling_factor))
        self.shift, self.scale = shift.view(1, -1, 1, 1, 1), scale.view(1, -1, 1, 1, 1)

    # ------------------------------------------------------------------ shapes
    @property
    def latent_channels(self) -> int:
        return self._channels

    @property
    def spatial_factor(self) -> int:
        return self._spatial

    @property
    def temporal_factor(self) -> int:
        return self._temporal

    @property
    def causal(self) -> bool:
        return self.kind in ("wan", "cogvideox")

    def latent_frames(self, frames: int) -> int:
        if not self.causal:
            return frames
        if frames < 1 or (frames - 1) % self._temporal:
            raise ConfigError(f"{frames} frames: a causal {self.kind} VAE needs 1 + k*{self._temporal} pixel frames "
                              f"(1, {1 + self._temporal}, {1 + 2 * self._temporal}, ...)")
        latent = 1 + (frames - 1) // self._temporal
        if self.kind == "cogvideox" and latent % 2 == 0:
            # Its decoder works on pairs of latent frames after an odd first group: an even latent
            # count decodes to 4 frames too few (2 latents -> 8 frames, not 5).
            raise ConfigError(f"{frames} frames: the cogvideox VAE needs an odd number of latent frames, i.e. "
                              f"1 + k*{2 * self._temporal} pixel frames (1, {1 + 2 * self._temporal}, "
                              f"{1 + 4 * self._temporal}, ... 49)")
        return latent

    def latent_shape(self, frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """(C, T', H', W') of a (3, frames, height, width) pixel clip; ConfigError if not encodable."""
        s = self._spatial
        if height % s or width % s:
            raise ConfigError(f"frame {height}x{width} is not divisible by the VAE's spatial factor {s}")
        return self._channels, self.latent_frames(frames), height // s, width // s

    def pixel_frames(self, latent_frames: int) -> int:
        return 1 + (latent_frames - 1) * self._temporal if self.causal else latent_frames

    def describe(self) -> dict:
        """JSON-able identity of the latent space (for checkpoint signatures)."""
        return {"class": type(self.vae).__name__, "channels": self._channels, "spatial_factor": self._spatial,
                "temporal_factor": self._temporal, "shift": [round(float(v), 8) for v in self.shift.flatten()],
                "scale": [round(float(v), 8) for v in self.scale.flatten()]}

    # ------------------------------------------------------------------ encode / decode
    def to(self, device) -> "VideoVae":
        self.vae.to(device)
        return self

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device

    def raw_encode(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, T, H, W) -> unnormalised posterior means (B, C, T', H', W')."""
        b, _, t = x.shape[:3]
        self.latent_shape(t, *x.shape[-2:])  # validate
        x = x.to(self.device, torch.float32)
        if self.causal:
            return self.vae.encode(x).latent_dist.mode()  # the mean: deterministic (see module doc)
        frames = x.permute(0, 2, 1, 3, 4).flatten(0, 1)  # (B*T, 3, H, W)
        z = self.vae.encode(frames).latent_dist.mode()
        return z.unflatten(0, (b, t)).permute(0, 2, 1, 3, 4)

    def raw_decode(self, z: torch.Tensor) -> torch.Tensor:
        """Unnormalised latents (B, C, T', H', W') -> (B, 3, T, H, W)."""
        z = z.to(self.device, torch.float32)
        if self.causal:
            return self.vae.decode(z).sample
        b, _, t = z.shape[:3]
        x = self.vae.decode(z.permute(0, 2, 1, 3, 4).flatten(0, 1)).sample
        return x.unflatten(0, (b, t)).permute(0, 2, 1, 3, 4)

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        return (z - self.shift.to(z)) * self.scale.to(z)

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        return z / self.scale.to(z) + self.shift.to(z)

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(self.raw_encode(x))

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.raw_decode(self.denormalize(latents.float()))
