"""Text-to-3D models. Architecture only; training and parallelism live in common/.

PointDiT (stage A, and the latent flow of stage B): a rectified-flow set transformer on the shared
DiT trunk (common/nn/dit.py). Every point (xyz + rgb) or latent vector is one token; there is no
positional encoding, so the model is permutation-equivariant: permuting the input tokens permutes
the output the same way. Text enters by cross-attention and the pooled caption through adaLN.

    points (B, N, C) -> Linear -> tokens -> DiT blocks (self-attn, cross-attn to text, MLP) -> adaLN final -> (B, N, C)

ShapeVAE (stage B): a vector-set autoencoder (3DShape2VecSet's design). Encoder: M queries, the
farthest-point samples of the input surface, cross-attend to all surface points, then self-attend;
a diagonal Gaussian of M x latent_dim comes out. Decoder: self-attention over the latent set, then
any query point cross-attends to it and reads off an occupancy logit and a colour.

    surface (B, S, 6) --FPS--> queries (B, M, W) --cross-attn--> self-attn x L_enc -> mean, logvar (B, M, d)
    z (B, M, d) -> Linear -> self-attn x L_dec -> latents;  xyz (B, Q, 3) --cross-attn--> (occupancy logit, rgb)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from common.geometry import farthest_point_sample
from common.nn.attention import CrossAttention, SelfAttention
from common.nn.dit import DiTTrunk, DiTTrunkConfig, preset_config, trunk_flops
from common.nn.mlp import MLP
from common.nn.norm import LayerNorm


# --------------------------------------------------------------------------- PointDiT
@dataclass
class PointDiTConfig(DiTTrunkConfig):
    num_points: int = 256   # tokens per sample: points (stage A) or latent vectors (stage B)
    in_channels: int = 6    # xyz + rgb, or the VAE's latent_dim

    @property
    def num_tokens(self) -> int:
        return self.num_points


_PRESETS = {
    # CPU demo: 256 points, width 128, depth 4 (~1.3M parameters).
    "tiny": dict(num_points=256, hidden=128, depth=4, heads=4, text_dim=128),
    # DiT-S/B/XL widths; Point-E's base model generates 1024 points, its upsampler 4096.
    "S": dict(num_points=1024, hidden=384, depth=12, heads=6, text_dim=512),
    "B": dict(num_points=1024, hidden=768, depth=12, heads=12, text_dim=512),
    "XL": dict(num_points=4096, hidden=1152, depth=28, heads=16, text_dim=768),
}


def point_dit_config(name: str, **overrides) -> PointDiTConfig:
    return preset_config(PointDiTConfig, _PRESETS, name, **overrides)


class PointEmbed(nn.Module):
    """Each token's values -> width; no position (named `proj` as the DiT family's patch embeds)."""

    def __init__(self, in_channels: int, hidden: int):
        super().__init__()
        self.proj = nn.Linear(in_channels, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class PointDiT(DiTTrunk):
    def __init__(self, cfg: PointDiTConfig):
        if cfg.hidden % cfg.heads:
            raise ValueError(f"hidden/heads = {cfg.hidden}/{cfg.heads}: hidden must be divisible by heads")
        super().__init__(PointEmbed(cfg.in_channels, cfg.hidden), cfg, out_dim=cfg.in_channels)
        self.cfg = cfg
        self.reset_parameters()

    # The DiT family's hooks (common/nn/dit_parallel.py): a set has one axis and no RoPE table.
    def default_grid(self) -> tuple[int]:
        return (self.cfg.num_points,)

    def rope(self, *grid, device=None) -> None:
        return None

    def embed(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
              context_mask: torch.Tensor | None = None):
        """Everything before the blocks: (tokens (B, N, D), t0 (B, 6D), temb (B, D), text (B, L, D))."""
        h = self.patch_embed(x)
        return (h, *self.condition(t, context, context_mask, h.dtype))

    def head(self, h: torch.Tensor, temb: torch.Tensor, grid=None) -> torch.Tensor:
        return self.final(h, temb)

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                context_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, N, C) tokens in any order; t (B,) in [0, 1] (0 = data); context (B, L, text_dim);
        context_mask (B, L) bool True = real token. Returns the velocity (B, N, C)."""
        h, t0, temb, ctx = self.embed(x, t, context, context_mask)
        h = self.run_blocks(h, t0, ctx, context_mask, None)
        return self.head(h, temb)

    def flops_per_sample(self, num_tokens: int | None = None, text_len: int | None = None) -> int:
        """Forward FLOPs per sample (2 per multiply-add): the trunk, all-pairs self-attention and
        the per-token input and output linears."""
        c = self.cfg
        n = c.num_points if num_tokens is None else num_tokens
        lt = c.text_len if text_len is None else text_len
        return int(trunk_flops(c, n, lt) + c.depth * 4 * n * n * c.hidden + 2 * 2 * n * c.in_channels * c.hidden)


# --------------------------------------------------------------------------- ShapeVAE
@dataclass
class ShapeVAEConfig:
    width: int = 128
    heads: int = 4
    latents: int = 64          # M: latent vectors (farthest-point-sampled queries)
    latent_dim: int = 8        # d: channels per latent vector
    enc_layers: int = 1        # self-attention blocks after the cross-attention
    dec_layers: int = 3
    mlp_ratio: float = 4.0
    fourier_freqs: int = 8     # sin/cos octaves of xyz fed to both ends


class FourierPoints(nn.Module):
    """xyz (+ extra channels) -> width: [xyz, sin(2^k pi xyz), cos(2^k pi xyz)] (+ extra) -> Linear.
    Fixed octaves resolve fine surface detail that a plain linear of xyz cannot."""

    def __init__(self, freqs: int, width: int, extra: int = 0):
        super().__init__()
        self.register_buffer("octaves", (2.0 ** torch.arange(freqs)) * math.pi, persistent=False)
        self.proj = nn.Linear(3 + 6 * freqs + extra, width)

    def forward(self, xyz: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        a = (xyz[..., None] * self.octaves).flatten(-2)
        parts = [xyz, a.sin(), a.cos()] + ([extra] if extra is not None else [])
        return self.proj(torch.cat(parts, -1))


class SetBlock(nn.Module):
    """Pre-norm transformer block over a set (no positions): x += SelfAttn(LN x); x += MLP(LN x)."""

    def __init__(self, width: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.norm1, self.attn = LayerNorm(width), SelfAttention(width, heads)
        self.norm2, self.mlp = LayerNorm(width), MLP(width, int(width * mlp_ratio))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class CrossBlock(nn.Module):
    """Queries read a set: q += CrossAttn(LN q, LN set); q += MLP(LN q)."""

    def __init__(self, width: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.norm_q, self.norm_kv = LayerNorm(width), LayerNorm(width)
        self.attn = CrossAttention(width, heads)
        self.norm2, self.mlp = LayerNorm(width), MLP(width, int(width * mlp_ratio))

    def forward(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        q = q + self.attn(self.norm_q(q), self.norm_kv(kv))
        return q + self.mlp(self.norm2(q))


class ShapeVAE(nn.Module):
    """forward(surface, query_xyz, eps) -> (decoded (B, Q, 4): occupancy logit + rgb in [-1, 1],
    KL per sample (B,)). surface (B, S, 6) xyz + rgb in model space; eps (B, M, d) the
    reparameterisation noise (given, so that it is seeded per sample by the caller), None = the mean."""

    def __init__(self, cfg: ShapeVAEConfig):
        super().__init__()
        self.cfg = cfg
        w = cfg.width
        self.surface_embed = FourierPoints(cfg.fourier_freqs, w, extra=3)
        self.query_embed = FourierPoints(cfg.fourier_freqs, w)
        self.encode_cross = CrossBlock(w, cfg.heads, cfg.mlp_ratio)
        self.encoder = nn.ModuleList(SetBlock(w, cfg.heads, cfg.mlp_ratio) for _ in range(cfg.enc_layers))
        self.to_moments = nn.Sequential(LayerNorm(w), nn.Linear(w, 2 * cfg.latent_dim))
        self.from_latent = nn.Linear(cfg.latent_dim, w)
        self.decoder = nn.ModuleList(SetBlock(w, cfg.heads, cfg.mlp_ratio) for _ in range(cfg.dec_layers))
        self.decode_cross = CrossBlock(w, cfg.heads, cfg.mlp_ratio)
        self.out = nn.Sequential(LayerNorm(w), nn.Linear(w, 4))

    def blocks(self) -> list[nn.Module]:
        """The FSDP sharding units."""
        return [self.encode_cross, *self.encoder, *self.decoder, self.decode_cross]

    def encode(self, surface: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, logvar), each (B, M, d)."""
        xyz, rgb = surface[..., :3], surface[..., 3:]
        with torch.no_grad():
            idx = farthest_point_sample(xyz, self.cfg.latents)
        pick = idx[..., None].expand(-1, -1, surface.shape[-1])
        queries = torch.gather(surface, 1, pick)
        h = self.encode_cross(self.surface_embed(queries[..., :3], queries[..., 3:]), self.surface_embed(xyz, rgb))
        for block in self.encoder:
            h = block(h)
        mean, logvar = self.to_moments(h).chunk(2, -1)
        return mean, logvar.clamp(-30.0, 20.0)

    def latents(self, z: torch.Tensor) -> torch.Tensor:
        """z (B, M, d) -> the decoder's latent set (B, M, W); compute once, query many times."""
        h = self.from_latent(z)
        for block in self.decoder:
            h = block(h)
        return h

    def query(self, latents: torch.Tensor, xyz: torch.Tensor) -> torch.Tensor:
        """(B, Q, 4): occupancy logit, rgb in [-1, 1] at each query point."""
        return self.out(self.decode_cross(self.query_embed(xyz), latents))

    def forward(self, surface: torch.Tensor, query_xyz: torch.Tensor, eps: torch.Tensor | None = None):
        mean, logvar = self.encode(surface)
        z = mean if eps is None else mean + (0.5 * logvar).exp() * eps
        kl = 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).flatten(1).mean(1)
        return self.query(self.latents(z), query_xyz), kl

    def flops_per_sample(self, surface: int, queries: int) -> int:
        """Forward FLOPs per sample (2 per multiply-add) of the linears and attention."""
        c, w = self.cfg, self.cfg.width
        m, mlp = c.latents, int(w * c.mlp_ratio)
        emb = 2 * (surface + m) * (9 + 6 * c.fourier_freqs) * w + 2 * queries * (3 + 6 * c.fourier_freqs) * w

        def cross(nq, nk):
            return 2 * nq * w * w * 2 + 2 * nk * w * w * 2 + 4 * nq * nk * w + 4 * nq * w * mlp

        def self_block(n):
            return 2 * n * w * w * 4 + 4 * n * n * w + 4 * n * w * mlp

        return int(emb + cross(m, surface) + (c.enc_layers + c.dec_layers) * self_block(m) + cross(queries, m)
                   + 2 * m * w * 2 * c.latent_dim + 2 * m * c.latent_dim * w + 2 * queries * w * 4)
