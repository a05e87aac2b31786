"""The vision-language model: open_clip ViT -> pixel shuffle -> MLP projector -> Llama decoder.

    tiles (N, 3, S, S) -> ViT patch tokens (N, g*g, C) -> pixel shuffle (N, (g/s)^2, s*s*C)
      -> projector (LayerNorm, Linear, GELU, Linear) + a learned embedding of the token's place in
      the tile -> (N, T, D) image embeddings
    tokens (R, L) -> LM embeddings; the image-token placeholders (R, L) == image_token_id are
      replaced, in row-major order, by the image embeddings of the row's tiles in order
      -> Llama blocks over packed rows (segments derived from `positions`) -> logits (R, L, V)

Every input is batched by row (tokens, positions, tiles (R, K, 3, S, S) with tile_mask (R, K)),
so data and pipeline parallelism split a batch along dim 0 without knowing what a row holds.
Packed rows: `positions` restart at 0 where a sample (or a row's padding tail) starts, which is
all the model needs to rebuild the varlen segment offsets (cu_seqlens).

Architecture only: how the ViT's work is spread over ranks is `vision_dispatch` (identity by
default; common/nn/vlm_parallel.py plugs in the balanced version).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.data.packing import IGNORE_INDEX, segments_from_positions
from common.nn.llama import Llama


def pixel_shuffle(tokens: torch.Tensor, grid: int, s: int) -> torch.Tensor:
    """(N, grid*grid, C) row-major patch tokens -> (N, (grid/s)^2, s*s*C): each s x s window of
    neighbouring patches becomes one token (InternVL's token merge; fewer LM tokens per tile)."""
    if s == 1:
        return tokens
    n, t, c = tokens.shape
    if t != grid * grid or grid % s:
        raise ValueError(f"pixel shuffle: {t} tokens are not a {grid} x {grid} grid divisible by {s}")
    g = grid // s
    x = tokens.view(n, g, s, g, s, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(n, g * g, s * s * c)


class Projector(nn.Module):
    """LayerNorm, Linear, GELU, Linear, plus a learned embedding of each token's place in its tile:
    the LM's RoPE only orders the image tokens relative to the text around them, and CLIP's
    objective does not keep the ViT's position embedding legible in its output tokens."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, tokens: int):
        super().__init__()
        self.norm = nn.LayerNorm(in_dim)
        self.fc1 = nn.Linear(in_dim, hidden)
        self.fc2 = nn.Linear(hidden, out_dim)
        self.pos = nn.Parameter(torch.randn(tokens, out_dim) * 0.02)

    def no_weight_decay(self) -> set[str]:
        return {"pos"}  # an additive table, not a map (common.optim.declared_no_decay)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x)))) + self.pos


def run_vision(visual: nn.Module, tiles: torch.Tensor) -> torch.Tensor:
    """ViT patch tokens (N, g*g, C), without building a graph when the tower is frozen."""
    from pipelines.vlm.clip import vision_tokens
    if any(p.requires_grad for p in visual.parameters()):
        return vision_tokens(visual, tiles)
    with torch.no_grad():
        return vision_tokens(visual, tiles)


class VisionLanguageModel(nn.Module):
    EMBED_MODULES = ("visual", "projector")  # what the first pipeline stage holds besides the LM's embedding

    def __init__(self, visual: nn.Module, lm: Llama, *, vision_width: int, grid: int, shuffle: int,
                 projector_hidden: int, image_token_id: int):
        super().__init__()
        self.visual = visual
        self.lm = lm
        self.grid, self.shuffle, self.image_token_id = grid, shuffle, image_token_id
        self.projector = Projector(vision_width * shuffle * shuffle, projector_hidden or lm.cfg.dim, lm.cfg.dim,
                                   (grid // shuffle) ** 2)
        # (fn, tiles) -> fn(tiles): where the tiles' ViT work runs (data-parallel balancing plugs in here).
        self.vision_dispatch = lambda fn, tiles: fn(tiles)

    @property
    def tokens_per_tile(self) -> int:
        return (self.grid // self.shuffle) ** 2

    def encode_tiles(self, tiles: torch.Tensor) -> torch.Tensor:
        """(N, 3, S, S) -> image embeddings (N, tokens_per_tile, D)."""
        feats = self.vision_dispatch(lambda x: run_vision(self.visual, x), tiles)
        return self.projector(pixel_shuffle(feats, self.grid, self.shuffle))

    def embed(self, tokens: torch.Tensor, tiles: torch.Tensor, tile_mask: torch.Tensor) -> torch.Tensor:
        """LM input embeddings (R, L, D) with every image placeholder replaced."""
        h = self.lm.tok_embeddings(tokens)
        slots = tokens == self.image_token_id
        flat_tiles = tiles[tile_mask]
        need = int(slots.sum())
        if need != flat_tiles.shape[0] * self.tokens_per_tile:
            raise ValueError(f"{need} image placeholders in the tokens but {flat_tiles.shape[0]} tiles x "
                             f"{self.tokens_per_tile} tokens")
        if need == 0:
            # Keep the vision path in the graph (zero contribution): every rank's backward then
            # reaches the same parameters, which data-parallel reductions rely on.
            return h + 0.0 * self.encode_tiles(tiles.new_zeros((0, *tiles.shape[2:]))).sum()
        feats = self.encode_tiles(flat_tiles)
        return h.masked_scatter(slots.unsqueeze(-1), feats.to(h.dtype))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, tiles: torch.Tensor,
                tile_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens, tiles, tile_mask)
        cu, longest = segments_from_positions(positions)
        return self.lm.output(self.lm.hidden_states(inputs_embeds=h, positions=positions, cu_seqlens=cu,
                                                    max_seqlen=longest))


def lm_loss(logits: torch.Tensor, target: torch.Tensor, average: str = "token") -> torch.Tensor:
    """Cross-entropy over assistant tokens. target (R, 2, L): [next-token targets with IGNORE_INDEX,
    positions]. token: mean over the loss tokens; sample: mean over samples (segments) with loss
    tokens of their mean token loss. A batch without loss tokens gives 0 (differentiable)."""
    tgt, pos = target[:, 0], target[:, 1]
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits  # fp64 stays fp64
    loss = F.cross_entropy(x.flatten(0, 1), tgt.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    counted = tgt.flatten() != IGNORE_INDEX
    if average == "token":
        return loss.sum() / counted.sum().clamp_min(1)
    seg = torch.cumsum(pos.flatten() == 0, 0) - 1
    n = int(seg[-1]) + 1
    total = loss.new_zeros(n).index_add(0, seg, loss)
    count = torch.zeros(n, dtype=torch.long, device=loss.device).index_add(0, seg, counted.long())
    has = count > 0
    return (total[has] / count[has]).sum() / has.sum().clamp_min(1)
