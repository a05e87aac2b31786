"""The DiT family's shared trunk (image and video DiT): adaLN-single timestep conditioning, caption
and pooled-caption projections, a stack of DiTBlocks and the final adaLN layer.

A member adds only its geometry: the patch embedding (handed to this constructor, so parameters
are created in the same order for every member), absolute positions, the RoPE table and the
unpatchify. Parallel plans for the family are in common/nn/dit_parallel.py.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from .attention import trim_key_padding
from .dit_block import DiTBlock, FinalLayer, reset_dit_parameters
from .embed import CaptionProjection, TimestepEmbedder


@dataclass
class DiTTrunkConfig:
    """The trunk's sizes; a member's config extends it with its geometry (input size, patches)."""
    hidden: int = 192
    depth: int = 6
    heads: int = 4
    mlp_ratio: float = 4.0
    text_dim: int = 128
    text_len: int = 32          # used by the FLOP estimate only
    qk_norm: bool = True
    rope_theta: float = 10000.0
    # Mean of the text tokens added to the timestep embedding, so the caption also reaches every
    # block through adaLN (the pooled-text vector of SD3/Flux), besides cross-attention.
    pooled_text: bool = True


def preset_config(cls: type, presets: dict[str, dict], name: str, **overrides):
    """cls(**presets[name]) with `overrides` replacing fields; ValueError naming an unknown preset
    or field."""
    if name not in presets:
        raise ValueError(f"unknown {cls.__name__.removesuffix('Config')} preset {name!r}; choose from {sorted(presets)}")
    bad = set(overrides) - {f.name for f in fields(cls)}
    if bad:
        raise ValueError(f"unknown {cls.__name__} fields {sorted(bad)}")
    return replace(cls(**presets[name]), **overrides)


def trunk_flops(cfg: DiTTrunkConfig, num_tokens: int, text_len: int) -> int:
    """Forward FLOPs per sample (2 per multiply-add) of the trunk's matmuls except self-attention's
    scores and weighted sum (which depend on the member's attention pattern): per block qkv and
    output projections, cross-attention and MLP; the conditioning (timestep MLP, adaLN-single,
    caption and pooled-caption projections). Norms and elementwise ops are ignored (<1%).
    text_len is the padded context length, so where cross-attention drops the key padding no
    sample uses (eager CPU, common.nn.attention) this is an upper bound."""
    n, lt, d = num_tokens, text_len, cfg.hidden
    mlp = int(d * cfg.mlp_ratio)
    per_block = (2 * n * d * 3 * d + 2 * n * d * d                     # self-attn qkv, out
                 + 2 * n * d * d + 2 * lt * d * 2 * d + 2 * n * d * d  # cross q, kv, out
                 + 4 * n * lt * d                                      # cross scores + AV
                 + 2 * 2 * n * d * mlp)                                # MLP
    cond = 2 * (256 * d + d * d + d * 6 * d) + 2 * lt * (cfg.text_dim * d + d * d)
    if cfg.pooled_text:
        cond += 2 * (cfg.text_dim * d + d * d)
    return cfg.depth * per_block + cond


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """(B, L, D) -> (B, D) mean over valid tokens (mask True = valid); all-masked rows give 0."""
    if mask is None:
        return x.mean(1)
    w = mask.to(x.dtype)[..., None]
    return (x * w).sum(1) / w.sum(1).clamp_min(1.0)


class DiTTrunk(nn.Module):
    # Submodules that run before the blocks (owned by the first pipeline stage).
    EMBED_MODULES = ("patch_embed", "t_embedder", "t_block", "caption_proj", "pooled_proj")

    def __init__(self, patch_embed: nn.Module, cfg: DiTTrunkConfig, out_dim: int):
        """patch_embed: the member's input -> (B, N, hidden) tokens; out_dim: values per token
        of the final layer (patch values to unpatchify)."""
        super().__init__()
        d = cfg.hidden
        self.patch_embed = patch_embed
        self.t_embedder = TimestepEmbedder(d)
        self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))  # adaLN-single global t0
        self.caption_proj = CaptionProjection(cfg.text_dim, d)
        self.pooled_proj = CaptionProjection(cfg.text_dim, d) if cfg.pooled_text else None
        self.blocks = nn.ModuleList(DiTBlock(d, cfg.heads, cfg.mlp_ratio, qk_norm=cfg.qk_norm)
                                    for _ in range(cfg.depth))
        self.final = FinalLayer(d, out_dim)

    def reset_parameters(self) -> None:
        reset_dit_parameters(self)  # identity blocks, zero final layer

    def parallel_limits(self) -> dict[str, str]:
        """{parallel dimension: why this member cannot use it}; the trunk's plan
        (common/nn/dit_parallel.py) covers them all, a member narrows it."""
        return {}

    def condition(self, t: torch.Tensor, context: torch.Tensor, context_mask: torch.Tensor | None,
                  dtype: torch.dtype):
        """(t0 (B, 6D) for every block's adaLN, temb (B, D) for the final layer, projected text (B, L, D))."""
        temb = self.t_embedder(t)
        if self.pooled_proj is not None:
            temb = temb + self.pooled_proj(masked_mean(context.to(dtype), context_mask))
        return self.t_block(temb), temb, self.caption_proj(context.to(dtype))

    def run_blocks(self, h, t0, ctx, context_mask, rope, blocks=None) -> torch.Tensor:
        """Runs `blocks` (default: all; a pipeline stage passes its own) on the tokens h."""
        # The text keys no sample uses are dropped once here, outside per-block compiled code,
        # which cannot (a data-dependent length); eager blocks then find nothing left to trim.
        ctx, context_mask = trim_key_padding(ctx, context_mask)
        for block in self.blocks if blocks is None else blocks:
            h = block(h, t0, ctx, context_mask, rope)
        return h
