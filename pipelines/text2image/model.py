"""Text-to-image model: frozen open_clip text tower + DiT (adaLN-single, cross-attention to
text tokens, 2-D RoPE, QK-norm). Architecture only; training and parallelism live elsewhere.

DiT forward:  patches -> tokens (+ 2-D RoPE in attention, no absolute embedding)
              t -> temb -> t0 = Linear(SiLU(temb)) (6D, shared by all blocks)
              text tokens -> caption projection -> blocks (cross-attention) -> final layer
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from common.kernels import rope_frequencies
from common.nn import (CaptionProjection, DiTBlock, FinalLayer, PatchEmbed2d, TimestepEmbedder, reset_dit_parameters,
                       sincos_2d, unpatchify)


# --------------------------------------------------------------------------- text encoder
@dataclass
class TextEncoderConfig:
    width: int = 128
    layers: int = 2
    heads: int = 4
    context_length: int = 32
    vocab_size: int = 49408
    weights: str | None = None  # local state-dict file (open_clip text keys); None = random init
    # open_clip LayerScale on the residual branches (None: plain CLIP blocks, as pretrained
    # checkpoints have). A small value keeps a *random* frozen tower close to its token
    # embeddings: without it, random attention/MLP branches outweigh the embeddings and hash each
    # word together with its prefix, so "circle" after "red" and after "blue" look unrelated.
    layer_scale: float | None = None


class TextEncoder(nn.Module):
    """Frozen open_clip TextTransformer returning per-token features for cross-attention.

    Built with open_clip's own `_build_text_tower` (causal CLIP text transformer, BPE tokenizer
    bundled with open_clip, so no network). Always in eval mode with requires_grad False; the
    forward runs under no_grad.
    """

    def __init__(self, cfg: TextEncoderConfig | None = None):
        super().__init__()
        from open_clip.model import CLIPTextCfg, _build_text_tower
        from open_clip.tokenizer import SimpleTokenizer

        self.cfg = cfg = cfg or TextEncoderConfig()
        text_cfg = CLIPTextCfg(context_length=cfg.context_length, vocab_size=cfg.vocab_size, width=cfg.width,
                               heads=cfg.heads, layers=cfg.layers, output_tokens=True, proj_type="none",
                               ls_init_value=cfg.layer_scale)
        self.tower = _build_text_tower(cfg.width, text_cfg)
        self.tokenizer = SimpleTokenizer(context_length=cfg.context_length)
        if cfg.weights:
            self.load_weights(cfg.weights)
        self.requires_grad_(False)
        self.eval()

    @property
    def width(self) -> int:
        return self.cfg.width

    def load_weights(self, path: str) -> None:
        """Load a text-tower or full CLIP state dict (keys not in the tower, e.g. visual.*, are
        ignored; a tower key missing from the file is an error)."""
        sd = torch.load(path, map_location="cpu", weights_only=True)
        sd = sd.get("state_dict", sd)
        sd = {k.removeprefix("module."): v for k, v in sd.items()}
        own = self.tower.state_dict()
        missing = [k for k in own if k not in sd]
        if missing:
            raise KeyError(f"text encoder weights {path} lack keys: {missing[:5]}...")
        self.tower.load_state_dict({k: sd[k] for k in own})

    def train(self, mode: bool = True):
        return super().train(False)  # frozen: never leave eval mode (no dropout)

    def tokenize(self, texts: list[str]) -> torch.Tensor:
        return self.tokenizer(list(texts))

    @torch.no_grad()
    def forward(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (tokens (B, L, width), key_padding_mask (B, L) bool, True = real token incl. SOT/EOT)."""
        ids = self.tokenize(texts).to(self.tower.token_embedding.weight.device)
        _, tokens = self.tower(ids)
        return tokens, ids != 0  # SimpleTokenizer pads with id 0


# --------------------------------------------------------------------------- DiT
@dataclass
class DiTConfig:
    img_size: int = 32
    in_channels: int = 3
    patch_size: int = 4
    hidden: int = 192
    depth: int = 6
    heads: int = 4
    mlp_ratio: float = 4.0
    text_dim: int = 128
    text_len: int = 32          # used by the FLOP estimate only
    qk_norm: bool = True
    rope_theta: float = 10000.0
    patch_embed: str = "conv"   # "conv" | "linear"
    # RoPE alone is relative: "top left" or "in the centre" can only be inferred from border
    # effects. A fixed sin-cos table (as in DiT) gives every token its absolute place.
    abs_pos: bool = True
    # Mean of the text tokens added to the timestep embedding, so the caption also reaches every
    # block through adaLN (the pooled-text vector of SD3/Flux), besides cross-attention.
    pooled_text: bool = True

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
    if name not in _PRESETS:
        raise ValueError(f"unknown DiT preset {name!r}; choose from {sorted(_PRESETS)}")
    known = {f.name for f in fields(DiTConfig)}
    bad = set(overrides) - known
    if bad:
        raise ValueError(f"unknown DiTConfig fields {sorted(bad)}")
    return replace(DiTConfig(**_PRESETS[name]), **overrides)


def dit_flops(cfg: DiTConfig, num_tokens: int | None = None, text_len: int | None = None) -> int:
    """Forward FLOPs per sample (2 per multiply-add) of matmuls and attention; norms,
    activations and elementwise ops are ignored (<1%). Training is about 3x this."""
    n = cfg.num_tokens if num_tokens is None else num_tokens
    lt = cfg.text_len if text_len is None else text_len
    d, pd = cfg.hidden, cfg.patch_size ** 2 * cfg.in_channels
    mlp = int(d * cfg.mlp_ratio)
    per_block = (2 * n * d * 3 * d + 2 * n * d * d + 4 * n * n * d       # self-attn
                 + 2 * n * d * d + 2 * lt * d * 2 * d + 2 * n * d * d    # cross q, kv, out
                 + 4 * n * lt * d                                        # cross scores + AV
                 + 2 * 2 * n * d * mlp)                                  # MLP
    embed = 2 * n * pd * d + 2 * n * d * pd                              # patch in, final out
    cond = 2 * (256 * d + d * d + d * 6 * d) + 2 * lt * (cfg.text_dim * d + d * d)
    return int(cfg.depth * per_block + embed + cond)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """(B, L, D) -> (B, D) mean over valid tokens (mask True = valid); all-masked rows give 0."""
    if mask is None:
        return x.mean(1)
    w = mask.to(x.dtype)[..., None]
    return (x * w).sum(1) / w.sum(1).clamp_min(1.0)


class DiT(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        head_dim = cfg.hidden // cfg.heads
        if cfg.hidden % cfg.heads or head_dim % 4:
            raise ValueError(f"hidden/heads = {cfg.hidden}/{cfg.heads} must give a head dim divisible by 4 "
                             "(2-D RoPE splits it into two rotate-half axes)")
        self.cfg = cfg
        d = cfg.hidden
        self.patch_embed = PatchEmbed2d(cfg.in_channels, d, cfg.patch_size, cfg.patch_embed)
        self.t_embedder = TimestepEmbedder(d)
        self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))  # adaLN-single global t0
        self.caption_proj = CaptionProjection(cfg.text_dim, d)
        self.pooled_proj = CaptionProjection(cfg.text_dim, d) if cfg.pooled_text else None
        self.blocks = nn.ModuleList(DiTBlock(d, cfg.heads, cfg.mlp_ratio, qk_norm=cfg.qk_norm)
                                    for _ in range(cfg.depth))
        self.final = FinalLayer(d, cfg.patch_size ** 2 * cfg.in_channels)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        reset_dit_parameters(self)

    def rope(self, grid_h: int, grid_w: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, col) integer positions, head dim split evenly between the two axes."""
        rows, cols = torch.meshgrid(torch.arange(grid_h, device=device), torch.arange(grid_w, device=device),
                                    indexing="ij")
        pos = torch.stack([rows.reshape(-1), cols.reshape(-1)], dim=-1)
        half = self.cfg.hidden // self.cfg.heads // 2
        return rope_frequencies(pos, (half, half), self.cfg.rope_theta)

    def embed(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
              context_mask: torch.Tensor | None = None):
        """Everything before the blocks: (tokens (B, N, D), t0 (B, 6D), temb (B, D), text (B, L, D))."""
        p = self.cfg.patch_size
        h = self.patch_embed(x)
        if self.cfg.abs_pos:
            h = h + sincos_2d(x.shape[-2] // p, x.shape[-1] // p, h.shape[-1], x.device).to(h.dtype)
        temb = self.t_embedder(t)
        if self.pooled_proj is not None:
            temb = temb + self.pooled_proj(_masked_mean(context.to(h.dtype), context_mask))
        return h, self.t_block(temb), temb, self.caption_proj(context.to(h.dtype))

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
        rope = self.rope(*grid, x.device)
        for block in self.blocks:
            h = block(h, t0, ctx, context_mask, rope)
        return self.head(h, temb, grid)

    def flops_per_sample(self, num_tokens: int | None = None, text_len: int | None = None) -> int:
        return dit_flops(self.cfg, num_tokens, text_len)
