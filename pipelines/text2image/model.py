"""Text-to-image DiT (adaLN-single, cross-attention to text tokens, 2-D RoPE, QK-norm) on the
shared DiT trunk (common/nn/dit.py); the frozen text tower is common/nn/text_encoder.py.
Architecture only; training and parallelism live in common/.

DiT forward:  patches -> tokens (+ 2-D RoPE in attention, no absolute embedding)
              t -> temb -> t0 = Linear(SiLU(temb)) (6D, shared by all blocks)
              text tokens -> caption projection -> blocks (cross-attention) -> final layer
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from common.kernels import rope_frequencies
from common.nn import PatchEmbed2d, sincos_2d, unpatchify
from common.nn.dit import DiTTrunk, DiTTrunkConfig, preset_config, trunk_flops


# --------------------------------------------------------------------------- DiT
@dataclass
class DiTConfig(DiTTrunkConfig):
    img_size: int = 32
    in_channels: int = 3
    patch_size: int = 4
    patch_embed: str = "conv"   # "conv" | "linear"
    # RoPE alone is relative: "top left" or "in the centre" can only be inferred from border
    # effects. A fixed sin-cos table (as in DiT) gives every token its absolute place.
    abs_pos: bool = True

    @property
    def num_tokens(self) -> int:
        return (self.img_size // self.patch_size) ** 2


_PRESETS = {
    # CPU demo on 32 px pixels. Patch 4 (64 tokens) rather than 2 (256): ~10x faster per step
    # on 2 CPU cores. Width 128 / depth 4 (~1.3M params, ~0.19 s per step of 32) rather than
    # 192 / 6: at a fixed few minutes, more optimizer steps beat more capacity here.
    "tiny": dict(img_size=32, in_channels=3, patch_size=4, hidden=128, depth=4, heads=4, text_dim=128),
    # Paper sizes (DiT-S/B/XL), on 32x32x4 latents (256 px with an 8x VAE).
    "S": dict(img_size=32, in_channels=4, patch_size=2, hidden=384, depth=12, heads=6, text_dim=512),
    "B": dict(img_size=32, in_channels=4, patch_size=2, hidden=768, depth=12, heads=12, text_dim=512),
    "XL": dict(img_size=32, in_channels=4, patch_size=2, hidden=1152, depth=28, heads=16, text_dim=768),
}


def dit_config(name: str, **overrides) -> DiTConfig:
    return preset_config(DiTConfig, _PRESETS, name, **overrides)


def dit_flops(cfg: DiTConfig, num_tokens: int | None = None, text_len: int | None = None) -> int:
    """Forward FLOPs per sample (2 per multiply-add) of matmuls and attention; norms,
    activations and elementwise ops are ignored (<1%). Training is about 3x this."""
    n = cfg.num_tokens if num_tokens is None else num_tokens
    lt = cfg.text_len if text_len is None else text_len
    d, pd = cfg.hidden, cfg.patch_size ** 2 * cfg.in_channels
    attn = cfg.depth * 4 * n * n * d                                     # self-attn scores + AV
    embed = 2 * n * pd * d + 2 * n * d * pd                              # patch in, final out
    return int(trunk_flops(cfg, n, lt) + attn + embed)


# Position tables depend only on the grid: built once per (grid, device) instead of in every
# forward (some 30 small ops a step). Read-only; callers never write into them. Built outside
# inference mode, so a table first made while sampling under torch.inference_mode() can still be
# saved for backward by a later training step.
@functools.lru_cache(maxsize=64)
@torch.inference_mode(False)
def _rope_2d(grid_h: int, grid_w: int, half: int, theta: float, device: torch.device):
    rows, cols = torch.meshgrid(torch.arange(grid_h, device=device), torch.arange(grid_w, device=device),
                                indexing="ij")
    pos = torch.stack([rows.reshape(-1), cols.reshape(-1)], dim=-1)
    return rope_frequencies(pos, (half, half), theta)


@functools.lru_cache(maxsize=64)
@torch.inference_mode(False)
def _sincos_2d(grid_h: int, grid_w: int, dim: int, device: torch.device) -> torch.Tensor:
    return sincos_2d(grid_h, grid_w, dim, device)


class DiT(DiTTrunk):
    def __init__(self, cfg: DiTConfig):
        head_dim = cfg.hidden // cfg.heads
        if cfg.hidden % cfg.heads or head_dim % 4:
            raise ValueError(f"hidden/heads = {cfg.hidden}/{cfg.heads} must give a head dim divisible by 4 "
                             "(2-D RoPE splits it into two rotate-half axes)")
        super().__init__(PatchEmbed2d(cfg.in_channels, cfg.hidden, cfg.patch_size, cfg.patch_embed), cfg,
                         out_dim=cfg.patch_size ** 2 * cfg.in_channels)
        self.cfg = cfg
        self.reset_parameters()

    def default_grid(self) -> tuple[int, int]:
        side = self.cfg.img_size // self.cfg.patch_size
        return side, side

    def rope(self, grid_h: int, grid_w: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, col) integer positions, head dim split evenly between the two axes."""
        half = self.cfg.hidden // self.cfg.heads // 2
        return _rope_2d(grid_h, grid_w, half, self.cfg.rope_theta, torch.device(device or "cpu"))

    def embed(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
              context_mask: torch.Tensor | None = None):
        """Everything before the blocks: (tokens (B, N, D), t0 (B, 6D), temb (B, D), text (B, L, D))."""
        p = self.cfg.patch_size
        h = self.patch_embed(x)
        if self.cfg.abs_pos:
            h = h + _sincos_2d(x.shape[-2] // p, x.shape[-1] // p, h.shape[-1], x.device).to(h.dtype)
        return (h, *self.condition(t, context, context_mask, h.dtype))

    def head(self, h: torch.Tensor, temb: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Final adaLN layer and unpatchify: tokens (B, N, D) -> (B, C, H, W)."""
        return unpatchify(self.final(h, temb), grid[0], grid[1], self.cfg.patch_size, self.cfg.in_channels)

    def grid(self, x: torch.Tensor) -> tuple[int, int]:
        return x.shape[-2] // self.cfg.patch_size, x.shape[-1] // self.cfg.patch_size

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                context_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, C, H, W); t (B,) in [0, 1] (0 = data); context (B, L, text_dim);
        context_mask (B, L) bool True = real token. Returns (B, C, H, W)."""
        grid = self.grid(x)
        h, t0, temb, ctx = self.embed(x, t, context, context_mask)
        h = self.run_blocks(h, t0, ctx, context_mask, self.rope(*grid, x.device))
        return self.head(h, temb, grid)

    def flops_per_sample(self, num_tokens: int | None = None, text_len: int | None = None) -> int:
        return dit_flops(self.cfg, num_tokens, text_len)
