"""The DiT family's shared trunk (image and video DiT): adaLN-single timestep conditioning, caption
and pooled-caption projections, a stack of DiTBlocks and the final adaLN layer.

A member adds only its geometry: the patch embedding (handed to this constructor, so parameters
are created in the same order for every member), absolute positions, the RoPE table and the
unpatchify. Parallel plans for the family are in common/nn/dit_parallel.py.
"""
from __future__ import annotations

import torch
from torch import nn

from .dit_block import DiTBlock, FinalLayer, reset_dit_parameters
from .embed import CaptionProjection, TimestepEmbedder


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """(B, L, D) -> (B, D) mean over valid tokens (mask True = valid); all-masked rows give 0."""
    if mask is None:
        return x.mean(1)
    w = mask.to(x.dtype)[..., None]
    return (x * w).sum(1) / w.sum(1).clamp_min(1.0)


class DiTTrunk(nn.Module):
    # Submodules that run before the blocks (owned by the first pipeline stage).
    EMBED_MODULES = ("patch_embed", "t_embedder", "t_block", "caption_proj", "pooled_proj")

    def __init__(self, patch_embed: nn.Module, *, hidden: int, heads: int, depth: int, mlp_ratio: float,
                 qk_norm: bool, text_dim: int, pooled_text: bool, out_dim: int):
        super().__init__()
        d = hidden
        self.patch_embed = patch_embed
        self.t_embedder = TimestepEmbedder(d)
        self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))  # adaLN-single global t0
        self.caption_proj = CaptionProjection(text_dim, d)
        # Mean of the text tokens added to the timestep embedding, so the caption also reaches
        # every block through adaLN (the pooled-text vector of SD3/Flux), besides cross-attention.
        self.pooled_proj = CaptionProjection(text_dim, d) if pooled_text else None
        self.blocks = nn.ModuleList(DiTBlock(d, heads, mlp_ratio, qk_norm=qk_norm) for _ in range(depth))
        self.final = FinalLayer(d, out_dim)

    def reset_parameters(self) -> None:
        reset_dit_parameters(self)  # identity blocks, zero final layer

    def condition(self, t: torch.Tensor, context: torch.Tensor, context_mask: torch.Tensor | None,
                  dtype: torch.dtype):
        """(t0 (B, 6D) for every block's adaLN, temb (B, D) for the final layer, projected text (B, L, D))."""
        temb = self.t_embedder(t)
        if self.pooled_proj is not None:
            temb = temb + self.pooled_proj(masked_mean(context.to(dtype), context_mask))
        return self.t_block(temb), temb, self.caption_proj(context.to(dtype))

    def run_blocks(self, h, t0, ctx, context_mask, rope) -> torch.Tensor:
        for block in self.blocks:
            h = block(h, t0, ctx, context_mask, rope)
        return h
