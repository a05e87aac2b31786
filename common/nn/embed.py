"""Patch embedding, (un)patchify and timestep embedding.

Token order is row-major over the (H/p, W/p) grid; a token's values are laid out (p, p, C)
(channels last), the layout the final layer predicts and `unpatchify` inverts.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .mlp import MLP


def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, (H/p)*(W/p), p*p*C)."""
    b, c, h, w = x.shape
    if h % p or w % p:
        raise ValueError(f"image {h}x{w} not divisible by patch size {p}")
    x = x.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(b, (h // p) * (w // p), p * p * c)


def unpatchify(x: torch.Tensor, grid_h: int, grid_w: int, p: int, channels: int) -> torch.Tensor:
    """(B, grid_h*grid_w, p*p*C) -> (B, C, grid_h*p, grid_w*p); inverse of patchify."""
    b = x.shape[0]
    x = x.view(b, grid_h, grid_w, p, p, channels).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(b, channels, grid_h * p, grid_w * p)


class PatchEmbed2d(nn.Module):
    """Non-overlapping p x p patches -> dim. "conv" (stride-p Conv2d) and "linear" (patchify +
    Linear) compute the same function; linear is simpler to shard with tensor parallelism."""

    def __init__(self, in_channels: int, dim: int, patch_size: int, mode: str = "conv"):
        super().__init__()
        self.patch_size, self.mode = patch_size, mode
        if mode == "conv":
            self.proj = nn.Conv2d(in_channels, dim, patch_size, stride=patch_size)
        elif mode == "linear":
            self.proj = nn.Linear(patch_size * patch_size * in_channels, dim)
        else:
            raise ValueError(f"PatchEmbed2d mode must be 'conv' or 'linear', got {mode!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "conv":
            # contiguous: elementwise ops keep their first input's layout, so a transposed view
            # here would make the whole residual stream channel-major, and every later norm and
            # linear copy it back (two copies per op, forward and backward) instead of this one.
            return self.proj(x).flatten(2).transpose(1, 2).contiguous()
        return self.proj(patchify(x, self.patch_size))


def sinusoidal_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """(B,) float -> (B, dim) [cos | sin] features, fp32."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1) if dim % 2 else emb


def sincos_2d(grid_h: int, grid_w: int, dim: int, device=None) -> torch.Tensor:
    """(grid_h * grid_w, dim) fixed absolute positions, row-major: half the channels encode the
    row, half the column (DiT's 2-D sin-cos table, computed for any grid so resolution can vary)."""
    if dim % 4:
        raise ValueError(f"sincos_2d needs dim divisible by 4, got {dim}")
    rows = torch.arange(grid_h, device=device, dtype=torch.float32)
    cols = torch.arange(grid_w, device=device, dtype=torch.float32)
    r = sinusoidal_embedding(rows, dim // 2)[:, None, :].expand(grid_h, grid_w, dim // 2)
    c = sinusoidal_embedding(cols, dim // 2)[None, :, :].expand(grid_h, grid_w, dim // 2)
    return torch.cat([r, c], dim=-1).reshape(grid_h * grid_w, dim)


class TimestepEmbedder(nn.Module):
    """t -> sinusoidal(time_scale * t) -> Linear-SiLU-Linear. time_scale=1000 maps flow times
    in [0, 1] onto the 0..1000 range the sinusoid frequencies were designed for (DiT, SD3)."""

    def __init__(self, dim: int, freq_dim: int = 256, time_scale: float = 1000.0):
        super().__init__()
        self.freq_dim, self.time_scale = freq_dim, time_scale
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        emb = sinusoidal_embedding(t * self.time_scale, self.freq_dim)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))


class CaptionProjection(MLP):
    """text_dim -> hidden (PixArt's y_embedder): Linear-GELU(tanh)-Linear."""

    def __init__(self, text_dim: int, dim: int):
        super().__init__(text_dim, dim, dim)


# --------------------------------------------------------------------------- 3-D (video) helpers
# Video tokens are ordered (t, h, w) row-major over the (T/tp, H/p, W/p) grid; a token's values
# are laid out (tp, p, p, C) (channels last), the layout the final layer predicts and
# `unpatchify3d` inverts. With tp = 1 and T = 1 this is exactly `patchify`'s layout.


def patchify3d(x: torch.Tensor, temporal_patch: int, patch: int) -> torch.Tensor:
    """(B, C, T, H, W) -> (B, (T/tp)*(H/p)*(W/p), tp*p*p*C)."""
    b, c, t, h, w = x.shape
    tp, p = temporal_patch, patch
    if t % tp or h % p or w % p:
        raise ValueError(f"video {t}x{h}x{w} not divisible by patch (t={tp}, h=w={p})")
    x = x.reshape(b, c, t // tp, tp, h // p, p, w // p, p).permute(0, 2, 4, 6, 3, 5, 7, 1)
    return x.reshape(b, (t // tp) * (h // p) * (w // p), tp * p * p * c)


def unpatchify3d(x: torch.Tensor, grid: tuple[int, int, int], temporal_patch: int, patch: int,
                 channels: int) -> torch.Tensor:
    """(B, gt*gh*gw, tp*p*p*C) -> (B, C, gt*tp, gh*p, gw*p); inverse of patchify3d."""
    (gt, gh, gw), tp, p = grid, temporal_patch, patch
    b = x.shape[0]
    x = x.reshape(b, gt, gh, gw, tp, p, p, channels).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return x.reshape(b, channels, gt * tp, gh * p, gw * p)


def grid_positions(*sizes: int, device=None) -> torch.Tensor:
    """Integer coordinates of a row-major grid: sizes (n0, n1, ...) -> (prod(sizes), len(sizes)) int64.
    The position table of N-d RoPE (`rope_frequencies`) and of `sincos_nd`."""
    axes = torch.meshgrid(*(torch.arange(n, device=device) for n in sizes), indexing="ij")
    return torch.stack([a.reshape(-1) for a in axes], dim=-1)


def sincos_nd(sizes: tuple[int, ...], dims_per_axis: tuple[int, ...], device=None) -> torch.Tensor:
    """(prod(sizes), sum(dims)) fixed absolute positions over a row-major N-d grid: axis a owns
    dims_per_axis[a] channels ([cos | sin] of its integer coordinate), axis after axis."""
    if len(sizes) != len(dims_per_axis) or any(d % 2 or d <= 0 for d in dims_per_axis):
        raise ValueError(f"sincos_nd needs one positive even dim per axis, got sizes {sizes} dims {dims_per_axis}")
    pos = grid_positions(*sizes, device=device).float()
    return torch.cat([sinusoidal_embedding(pos[:, a], d) for a, d in enumerate(dims_per_axis)], dim=-1)


class VideoPatchEmbed(nn.Module):
    """Non-overlapping tp x p x p patches -> dim. "conv" (Conv3d, kernel = stride) and "linear"
    (patchify3d + Linear) compute the same function; the conv weight (D, C, tp, p, p) permuted to
    (D, tp, p, p, C) is the linear weight."""

    def __init__(self, in_channels: int, dim: int, patch_size: int, temporal_patch: int = 1, mode: str = "linear"):
        super().__init__()
        self.patch_size, self.temporal_patch, self.mode = patch_size, temporal_patch, mode
        k = (temporal_patch, patch_size, patch_size)
        if mode == "conv":
            self.proj = nn.Conv3d(in_channels, dim, k, stride=k)
        elif mode == "linear":
            self.proj = nn.Linear(temporal_patch * patch_size * patch_size * in_channels, dim)
        else:
            raise ValueError(f"VideoPatchEmbed mode must be 'conv' or 'linear', got {mode!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, T, H, W) -> (B, N, dim), tokens in (t, h, w) row-major order."""
        if self.mode == "conv":
            return self.proj(x).flatten(2).transpose(1, 2).contiguous()  # see PatchEmbed2d.forward
        return self.proj(patchify3d(x, self.temporal_patch, self.patch_size))
