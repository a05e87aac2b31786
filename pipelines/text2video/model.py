"""Text-to-video model: the text2image DiT lifted to space-time. Architecture only.

VideoDiT forward:  x (B, C, T, H, W) -> pad T to a multiple of tp (copies of frame 0 in front)
                   -> tp x p x p patches -> tokens (t, h, w) row-major (+ 2-D sin-cos per frame)
                   t -> temb -> t0 (adaLN-single, shared by all blocks); text -> caption projection
                   -> DiT blocks (common.nn.DiTBlock; 3-D RoPE in self-attention, cross-attention
                   to text) -> final adaLN layer -> unpatchify -> drop the padding frames.

An image is a one-frame video (T = 1): with tp > 1 it is repeated to tp frames, becomes one
temporal token (t = 0), and the output keeps its last frame, so images and videos share every
weight and one batch can mix them by bucket (joint image-video training).

Attention: "full" attends over all T*H*W tokens (the mode context parallelism shards: its
ContextParallel replaces `block.attn.attn_impl`). "factorized" alternates spatial blocks (even
index: tokens of one frame, (B*T, H*W)) and temporal blocks (odd index: one spatial position
across frames, (B*H*W, T)); it is the cheap option for long clips on one device and is not
combined with context parallelism. The 3-D RoPE table is applied before the regrouping: within
a group the other axes' coordinates are equal, so their rotations cancel in q.k and the
factorized blocks see exactly the spatial (resp. temporal) RoPE slice.

Built on the shared DiT trunk (common/nn/dit.py: conditioning, blocks, final layer), so the
DiT family's parallel plans (common/nn/dit_parallel.py) apply unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from common.kernels import attention, rope_frequencies
from common.nn import VideoPatchEmbed, grid_positions, sincos_2d, sincos_nd, unpatchify3d
from common.nn.dit import DiTTrunk, DiTTrunkConfig, preset_config, trunk_flops


def default_rope_axes(head_dim: int) -> tuple[int, int, int]:
    """(t, h, w) RoPE channels of a head: h = w = 2*floor(3*head_dim/16) (3/8 each, rounded
    down to even), t = the rest (>= 1/4). 64 -> (16, 24, 24); 72 -> (20, 26, 26); 128 -> (32, 48, 48).
    Space gets more channels than time: spatial grids are larger than temporal ones, and each
    axis needs enough low frequencies to tell far positions apart."""
    if head_dim % 2 or head_dim < 8:
        raise ValueError(f"3-D RoPE needs an even head dim >= 8, got {head_dim}")
    hw = 2 * (3 * head_dim // 16)
    return head_dim - 2 * hw, hw, hw


@dataclass
class VideoDiTConfig(DiTTrunkConfig):
    frames: int = 8             # clip size: used by num_tokens (parallel checks) and the FLOP estimate
    height: int = 32
    width: int = 32
    in_channels: int = 3
    patch_size: int = 4         # spatial patch p
    temporal_patch: int = 2     # temporal patch tp
    hidden: int = 128
    depth: int = 4
    rope_axes_dim: tuple[int, int, int] | None = None  # (t, h, w) channels per head; None: default_rope_axes
    attention: str = "full"     # "full" | "factorized"
    patch_embed: str = "linear"  # "linear" (one GEMM, plain to shard) | "conv" (Conv3d); same function
    # "spatial": DiT's 2-D sin-cos table added to every frame's tokens; time is left to RoPE (a
    # clip is a random crop of a longer video, its first frame has no absolute meaning) and an
    # image (T=1) gets exactly the text2image DiT's token embedding, so image-DiT weights can
    # initialise a video DiT. "3d": sin-cos over (t, h, w) split like the RoPE axes. "none": RoPE only.
    abs_pos: str = "spatial"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def rope_axes(self) -> tuple[int, int, int]:
        return tuple(self.rope_axes_dim) if self.rope_axes_dim is not None else default_rope_axes(self.head_dim)

    @property
    def patch_dim(self) -> int:
        return self.temporal_patch * self.patch_size ** 2 * self.in_channels

    def grid(self, frames: int | None = None, height: int | None = None, width: int | None = None):
        """Token grid (gt, gh, gw) of a clip; frames are padded up to a multiple of temporal_patch."""
        f, h, w = frames or self.frames, height or self.height, width or self.width
        return math.ceil(f / self.temporal_patch), h // self.patch_size, w // self.patch_size

    def tokens(self, frames: int | None = None, height: int | None = None, width: int | None = None) -> int:
        return math.prod(self.grid(frames, height, width))

    @property
    def num_tokens(self) -> int:
        return self.tokens()


_PRESETS = {
    # CPU demo: pixel space 8 x 32 x 32, patches 2 x 4 x 4 -> 4 x 8 x 8 = 256 tokens (an image:
    # 64). Width 128 / depth 4 / head dim 32 (RoPE t, h, w = 8, 12, 12): ~1.3M params.
    "tiny": dict(frames=8, height=32, width=32, in_channels=3, patch_size=4, temporal_patch=2,
                 hidden=128, depth=4, heads=4, text_dim=128),
    # 17 frames at 256 px through a 4x-time / 8x-space causal VAE (16 ch): latents 5 x 32 x 32,
    # patches 1 x 2 x 2 -> 5 x 16 x 16 = 1280 tokens. DiT-S / DiT-B widths.
    "S": dict(frames=5, height=32, width=32, in_channels=16, patch_size=2, temporal_patch=1,
              hidden=384, depth=12, heads=6, text_dim=512, text_len=77),
    "B": dict(frames=5, height=32, width=32, in_channels=16, patch_size=2, temporal_patch=1,
              hidden=768, depth=12, heads=12, text_dim=512, text_len=77),
    # At-scale reference: 129 frames of 720p (1280 x 720) through the same VAE -> 16-ch latents
    # 33 x 90 x 160 (1 + 128/4 frames); patches 1 x 2 x 2 -> 33 x 45 x 80 = 118,800 tokens per
    # clip. Width 3072 / 24 heads (head dim 128, RoPE 32/48/48) / depth 40: ~6.2B params,
    # ~8.2 PFLOP per forward sample, ~84% of it in full attention (factorized: ~1.4 PFLOP):
    # context parallelism territory.
    "XL": dict(frames=33, height=90, width=160, in_channels=16, patch_size=2, temporal_patch=1,
               hidden=3072, depth=40, heads=24, text_dim=4096, text_len=256),
}


def video_dit_config(name: str, **overrides) -> VideoDiTConfig:
    return preset_config(VideoDiTConfig, _PRESETS, name, **overrides)


def video_dit_flops(cfg: VideoDiTConfig, frames: int | None = None, height: int | None = None,
                    width: int | None = None, text_len: int | None = None) -> int:
    """Forward FLOPs per sample (2 per multiply-add) of matmuls and attention for a clip of
    frames x height x width (defaults: the config's clip); norms, activations and elementwise
    ops are ignored (<1%). Training is about 3x this. Factorized attention: spatial blocks attend
    over gh*gw keys, temporal blocks over gt keys (the depth is split even/odd)."""
    gt, gh, gw = cfg.grid(frames, height, width)
    n = gt * gh * gw
    lt = cfg.text_len if text_len is None else text_len
    d, pd = cfg.hidden, cfg.patch_dim
    if cfg.attention == "full":
        attn = cfg.depth * 4 * n * n * d
    else:
        spatial, temporal = (cfg.depth + 1) // 2, cfg.depth // 2
        attn = spatial * 4 * n * (gh * gw) * d + temporal * 4 * n * gt * d
    embed = 2 * n * pd * d + 2 * n * d * pd                             # patch in, final out
    return int(trunk_flops(cfg, n, lt) + attn + embed)


class FactorizedAttention:
    """An `attn_impl` for SelfAttention: attends within frames ("spatial") or within spatial
    positions across time ("temporal"). q, k, v arrive as (B, H, T*S, Dh) in (t, s) token order,
    already rotated by the full 3-D RoPE. `frames` (the temporal grid gt) is set by
    VideoDiT.set_grid before the blocks run."""

    def __init__(self, axis: str):
        if axis not in ("spatial", "temporal"):
            raise ValueError(f"factorized attention axis must be 'spatial' or 'temporal', got {axis!r}")
        self.axis, self.frames = axis, None

    def __call__(self, q, k, v, causal: bool = False, attn_mask=None):
        if attn_mask is not None or causal:
            raise ValueError("factorized video attention takes no mask and is not causal")
        if self.frames is None:
            raise RuntimeError("FactorizedAttention.frames unset: call VideoDiT.set_grid(grid) first")
        b, h, n, dh = q.shape
        t = self.frames
        s = n // t

        def group(x):  # (B, H, T*S, Dh) -> (B*T, H, S, Dh) or (B*S, H, T, Dh)
            x = x.reshape(b, h, t, s, dh)
            x = x.permute(0, 2, 1, 3, 4) if self.axis == "spatial" else x.permute(0, 3, 1, 2, 4)
            return x.reshape(-1, h, *x.shape[-2:])

        out = attention(group(q), group(k), group(v))
        if self.axis == "spatial":
            out = out.reshape(b, t, h, s, dh).permute(0, 2, 1, 3, 4)
        else:
            out = out.reshape(b, s, h, t, dh).permute(0, 2, 3, 1, 4)
        return out.reshape(b, h, n, dh)


class VideoDiT(DiTTrunk):
    def __init__(self, cfg: VideoDiTConfig):
        if cfg.hidden % cfg.heads:
            raise ValueError(f"hidden {cfg.hidden} not divisible by heads {cfg.heads}")
        axes = cfg.rope_axes
        if len(axes) != 3 or sum(axes) != cfg.head_dim or any(a <= 0 or a % 2 for a in axes):
            raise ValueError(f"rope_axes_dim {axes} must be three positive even numbers summing to the "
                             f"head dim {cfg.head_dim}")
        if cfg.attention not in ("full", "factorized"):
            raise ValueError(f"attention must be 'full' or 'factorized', got {cfg.attention!r}")
        if cfg.abs_pos not in ("none", "spatial", "3d"):
            raise ValueError(f"abs_pos must be 'none', 'spatial' or '3d', got {cfg.abs_pos!r}")
        if cfg.abs_pos != "none" and cfg.hidden % 4:
            raise ValueError(f"abs_pos={cfg.abs_pos!r} needs hidden divisible by 4, got {cfg.hidden}")
        patch_embed = VideoPatchEmbed(cfg.in_channels, cfg.hidden, cfg.patch_size, cfg.temporal_patch, cfg.patch_embed)
        super().__init__(patch_embed, cfg, out_dim=cfg.patch_dim)
        self.cfg = cfg
        if cfg.attention == "factorized":
            for i, block in enumerate(self.blocks):
                block.attn.attn_impl = FactorizedAttention("spatial" if i % 2 == 0 else "temporal")
        self.reset_parameters()  # as the image DiT: identity blocks, zero final layer

    def parallel_limits(self) -> dict[str, str]:
        """Parallel dimensions this model cannot use, with the reason."""
        limits = {"pp": "pipeline stages are not built for the VideoDiT yet; use fsdp, tp or cp"}
        if self.cfg.attention != "full":
            limits["cp"] = (f"context parallelism shards the full-attention sequence; model.attention="
                            f"{self.cfg.attention!r} groups tokens by frame and by position across frames, which "
                            "the shards would cut (use model.attention=full, or parallel.cp=1)")
        return limits

    # ------------------------------------------------------------------ geometry
    def grid(self, x: torch.Tensor) -> tuple[int, int, int]:
        """(gt, gh, gw) token grid of x (B, C, T, H, W); T is padded up to a multiple of tp."""
        t, h, w = x.shape[-3:]
        p = self.cfg.patch_size
        if h % p or w % p:
            raise ValueError(f"frame {h}x{w} not divisible by patch size {p}")
        return math.ceil(t / self.cfg.temporal_patch), h // p, w // p

    def rope(self, grid_t: int, grid_h: int, grid_w: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """3-D RoPE tables (cos, sin), each (gt*gh*gw, head_dim), from integer (t, h, w) token
        positions; the head dim is split (t, h, w) = cfg.rope_axes."""
        pos = grid_positions(grid_t, grid_h, grid_w, device=device)
        return rope_frequencies(pos, self.cfg.rope_axes, self.cfg.rope_theta)

    def pos_embed(self, grid: tuple[int, int, int], device=None) -> torch.Tensor | None:
        """Absolute position table (gt*gh*gw, D) per cfg.abs_pos, or None."""
        gt, gh, gw = grid
        d = self.cfg.hidden
        if self.cfg.abs_pos == "spatial":
            return sincos_2d(gh, gw, d, device).repeat(gt, 1)
        if self.cfg.abs_pos == "3d":
            dt = d - 2 * (2 * (3 * d // 16))  # same split rule as the RoPE axes
            return sincos_nd(grid, (dt, (d - dt) // 2, (d - dt) // 2), device)
        return None

    def set_grid(self, grid: tuple[int, int, int]) -> None:
        """Tell factorized attention how many frames the token sequence holds (no-op for full)."""
        for block in self.blocks:
            impl = getattr(getattr(block, "attn", None), "attn_impl", None)
            if isinstance(impl, FactorizedAttention):
                impl.frames = grid[0]

    def pad_frames(self, x: torch.Tensor) -> torch.Tensor:
        """Pad T up to a multiple of tp with copies of frame 0 in front (an image becomes tp
        identical frames; a 4k+1-frame causal-VAE clip keeps its first frame in its own token)."""
        pad = -x.shape[2] % self.cfg.temporal_patch
        if pad:
            x = torch.cat([x[:, :, :1].expand(-1, -1, pad, -1, -1), x], dim=2)
        return x

    # ------------------------------------------------------------------ forward pieces
    def embed(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
              context_mask: torch.Tensor | None = None):
        """Everything before the blocks: (tokens (B, N, D), t0 (B, 6D), temb (B, D), text (B, L, D))."""
        grid = self.grid(x)
        h = self.patch_embed(self.pad_frames(x))
        pos = self.pos_embed(grid, x.device)
        if pos is not None:
            h = h + pos.to(h.dtype)
        return (h, *self.condition(t, context, context_mask, h.dtype))

    def head(self, h: torch.Tensor, temb: torch.Tensor, grid: tuple[int, int, int],
             frames: int | None = None) -> torch.Tensor:
        """Final adaLN layer and unpatchify: tokens (B, N, D) -> (B, C, T, H, W); `frames`
        (the input's T) drops the front padding, None keeps all gt*tp frames."""
        c = self.cfg
        out = unpatchify3d(self.final(h, temb), grid, c.temporal_patch, c.patch_size, c.in_channels)
        return out if frames is None else out[:, :, out.shape[2] - frames:]

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                context_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, C, T, H, W) (or (B, C, H, W): one frame); t (B,) in [0, 1] (0 = data); context
        (B, L, text_dim); context_mask (B, L) bool True = real token. Returns x's shape."""
        image = x.dim() == 4
        if image:
            x = x[:, :, None]
        grid = self.grid(x)
        self.set_grid(grid)
        h, t0, temb, ctx = self.embed(x, t, context, context_mask)
        h = self.run_blocks(h, t0, ctx, context_mask, self.rope(*grid, x.device))
        out = self.head(h, temb, grid, x.shape[2])
        return out[:, :, 0] if image else out

    def flops_per_sample(self, frames: int | None = None, height: int | None = None, width: int | None = None,
                         text_len: int | None = None) -> int:
        return video_dit_flops(self.cfg, frames, height, width, text_len)
