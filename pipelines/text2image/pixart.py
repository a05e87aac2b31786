"""PixArt-style text-to-image transformer: diffusers' `PixArtTransformer2DModel` (PixArt-alpha /
PixArt-Sigma) behind the DiT's interface (pipelines/text2image/model.py), so the text towers,
objectives, EMA, checkpoints, sampling and data parallelism of the pipeline apply unchanged, and
PixArt folders can be fine-tuned (model.preset=folder) and exported as diffusers' own
PixArtAlphaPipeline. Architecture only.

PixArt forward:  x -> patch embedding + fixed 2-D sin-cos positions -> N blocks (adaLN-single
                 modulated self-attention, cross-attention to the projected caption tokens, GELU
                 MLP) -> adaLN-single final norm -> linear -> unpatchify
                 t in [0, 1] -> t * 1000 -> sinusoid -> MLP -> one 6 x hidden modulation shared
                 by every block (each block adds its own learned table)
                 [1024 px models: image resolution and aspect ratio embedded beside t]
The checkpoints PixArt publishes predict 2 x channels (noise and a learned variance); the
variance half is dropped, as diffusers' PixArt pipelines drop it, so it takes no gradient here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from common.nn.dit import preset_config
from pipelines.text2image.diffusers_transformer import DiffusersTransformer, config_mismatch, init_params
from pipelines.text2image.unet import _plain

# The timestep scale of PixArt (1000 DDPM steps): t in [0, 1] becomes t * 1000.
TIME_SCALE = 1000.0
# model.preset=folder: the architecture of the PixArt transformer in model.init_from.
FOLDER_PRESET = "folder"
CLASS_NAME = "PixArtTransformer2DModel"


@dataclass
class PixArtConfig:
    img_size: int = 32           # model-input (pixel or latent) side
    in_channels: int = 3
    patch_size: int = 4
    text_dim: int = 128          # caption_channels: the text tower's width
    text_len: int = 32           # used by the FLOP count only
    hidden: int = 128
    depth: int = 4
    heads: int = 4
    # out_channels = 2 x in_channels (PixArt's noise + learned variance); the variance half is unused.
    learned_sigma: bool = False
    image_size: int = 32         # pixel side: the resolution condition of 1024 px models
    # Further PixArtTransformer2DModel arguments, over those the fields above give: the settings of a
    # diffusers folder (preset "folder") that they do not cover, e.g. sample_size, interpolation_scale.
    extra: dict = field(default_factory=dict)


_PRESETS = {
    # The DiT demo's size: 32 px pixels in 64 tokens of patch 4, width 128, 4 blocks.
    "tiny": dict(patch_size=4, hidden=128, depth=4, heads=4),
    # PixArt-alpha / Sigma XL/2 (T5-XXL captions, width 4096): 16 heads of 72, 28 blocks, learned sigma.
    "xl": dict(img_size=64, in_channels=4, patch_size=2, text_dim=4096, text_len=120, hidden=1152, depth=28,
               heads=16, learned_sigma=True, image_size=512),
}

# Parallel dimensions the PixArt wrapper has no plan for, with the reason (its parallel_limits()).
PARALLEL_LIMITS = {
    "tp": "the PixArt transformer (diffusers' modules) has no tensor-parallel plan; use data parallelism "
          "(parallel.dp_mode=fsdp or ddp), or model.arch=dit for tp",
    "cp": "the PixArt transformer's attention is diffusers' own, with no sequence-sharded path; use data "
          "parallelism, or model.arch=dit for cp",
    "pp": "pipeline stages are not built for the PixArt transformer; use data parallelism, or model.arch=dit for pp",
}

# Settings whose inputs this interface (image, timestep, text tokens) cannot supply, or that change
# the network into one the forward below does not drive, with why.
_REFUSED = {
    "norm_type": ("ada_norm_single", "only PixArt's adaLN-single blocks are built"),
    "attention_type": ("default", "gated (GLIGEN) attention needs grounding inputs"),
}


def pixart_config(name: str, **overrides) -> PixArtConfig:
    return preset_config(PixArtConfig, _PRESETS, name, **overrides)


def _init_params() -> dict:
    from diffusers import PixArtTransformer2DModel
    return init_params(PixArtTransformer2DModel)


def diffusers_kwargs(cfg: PixArtConfig) -> dict:
    """PixArtTransformer2DModel's constructor arguments for `cfg`."""
    if cfg.hidden % cfg.heads:
        raise ValueError(f"PixArt hidden={cfg.hidden} is not divisible by heads={cfg.heads}")
    kw = dict(num_attention_heads=cfg.heads, attention_head_dim=cfg.hidden // cfg.heads,
              in_channels=cfg.in_channels, out_channels=cfg.in_channels * (2 if cfg.learned_sigma else 1),
              num_layers=cfg.depth, cross_attention_dim=cfg.hidden, caption_channels=cfg.text_dim,
              sample_size=cfg.img_size, patch_size=cfg.patch_size, norm_type="ada_norm_single",
              # diffusers turns sample_size 128 on by itself; stated so that a folder's value decides
              use_additional_conditions=False)
    return {**kw, **cfg.extra}


def pixart_config_from_diffusers(config: dict, *, img_size: int, in_channels: int, text_dim: int, text_len: int,
                                 image_size: int) -> PixArtConfig:
    """The PixArtConfig of a diffusers PixArtTransformer2DModel config (its folder's config.json), for
    a run whose model input is in_channels x img_size^2, image_size px, and whose text tower is
    text_dim wide. Raises ValueError, naming the setting, for a transformer this pipeline cannot drive."""
    if config.get("_class_name", CLASS_NAME) != CLASS_NAME:
        raise ValueError(f"it holds a {config['_class_name']}, not a {CLASS_NAME}")
    params = _init_params()
    given = {k: v for k, v in config.items() if k in params}
    setting = {k: given.get(k, p.default) for k, p in params.items()}
    for key, (wanted, why) in _REFUSED.items():
        if setting[key] != wanted:
            raise ValueError(f"{key}={setting[key]!r} is not supported: {why}")
    out = setting["out_channels"] if setting["out_channels"] is not None else setting["in_channels"]
    if setting["in_channels"] != in_channels or out not in (in_channels, 2 * in_channels):
        raise ValueError(f"it maps {setting['in_channels']} to {out} channels, while this run's model input has "
                         f"{in_channels} (pixels: 3; latents: the VAE's channels, vae.path)")
    if setting["caption_channels"] != text_dim:
        raise ValueError(f"its caption_channels is {setting['caption_channels']}, while text.width={text_dim} "
                         "(set text.width, and text.hf_path to the text encoder it was trained with, e.g. T5)")
    if setting["cross_attention_dim"] != setting["num_attention_heads"] * setting["attention_head_dim"]:
        raise ValueError(f"cross_attention_dim={setting['cross_attention_dim']} differs from its width "
                         f"{setting['num_attention_heads']} x {setting['attention_head_dim']}")
    if img_size % setting["patch_size"]:
        raise ValueError(f"the model input side {img_size} is not divisible by its patch_size={setting['patch_size']}")
    fields = dict(img_size=img_size, in_channels=in_channels, patch_size=setting["patch_size"], text_dim=text_dim,
                  text_len=text_len, hidden=setting["num_attention_heads"] * setting["attention_head_dim"],
                  depth=setting["num_layers"], heads=setting["num_attention_heads"],
                  learned_sigma=out == 2 * in_channels, image_size=image_size)
    built = diffusers_kwargs(PixArtConfig(**fields))
    # Every other setting of the folder (its sample_size, which places the position table, the
    # resolution conditions, interpolation_scale, ...) passed on as it is: the same network.
    extra = {k: v for k, v in given.items()
             if _plain(v) != _plain(built[k] if k in built else params[k].default)}
    if "use_additional_conditions" not in given and setting["sample_size"] == 128:
        extra["use_additional_conditions"] = True  # what diffusers decides for a folder that leaves it unset
    return PixArtConfig(**fields, extra=extra)


def diffusers_config_mismatch(transformer: nn.Module, config: dict) -> list[str]:
    """The init settings in a folder's `config` that the built `transformer` does not have: empty
    when the two are the same architecture."""
    params = _init_params()
    wrong = config_mismatch(transformer, config, params)
    if "use_additional_conditions" not in config:
        expected = config.get("sample_size", params["sample_size"].default) == 128
        if transformer.use_additional_conditions != expected:
            wrong.append(f"use_additional_conditions: folder {expected} vs built {transformer.use_additional_conditions}")
    return wrong


def signature_fields(cfg: PixArtConfig) -> dict:
    """The config as checkpoints record it (common.checkpoint compares it before loading)."""
    return {"arch": "pixart", **dataclasses.asdict(cfg)}


def run_pixart(transformer: nn.Module, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor,
               context_mask: torch.Tensor | None, *, image_size: int) -> torch.Tensor:
    """A PixArtTransformer2DModel called as this pipeline trains it (and as diffusers' PixArt
    pipelines call it): timesteps in its units (t * 1000), the caption's padding mask, the
    resolution conditions of a 1024 px model from the square image side, and the noise half of a
    learned-sigma output."""
    b = x.shape[0]
    added = {"resolution": None, "aspect_ratio": None}
    if transformer.use_additional_conditions:
        added = {"resolution": x.new_full((b, 2), float(image_size)), "aspect_ratio": x.new_ones(b, 1)}
    mask = context_mask.to(x.dtype) if context_mask is not None else None
    out = transformer(x, encoder_hidden_states=context.to(x.dtype), timestep=timesteps, added_cond_kwargs=added,
                      encoder_attention_mask=mask, return_dict=False)[0]
    return out[:, :x.shape[1]]


class PixArt(DiffusersTransformer):
    """The text2image model interface on a diffusers PixArtTransformer2DModel (held as `transformer`)."""

    PARALLEL_LIMITS = PARALLEL_LIMITS

    def __init__(self, cfg: PixArtConfig):
        from diffusers import PixArtTransformer2DModel  # lazily: DiT-only runs do not import diffusers
        super().__init__(cfg, PixArtTransformer2DModel(**diffusers_kwargs(cfg)))

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                context_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, C, H, W); t (B,) in [0, 1] (0 = data); context (B, L, text_dim);
        context_mask (B, L) bool True = real token. Returns (B, C, H, W)."""
        p = self.cfg.patch_size
        if x.shape[-2] % p or x.shape[-1] % p:
            raise ValueError(f"PixArt input {tuple(x.shape[-2:])} is not divisible by its patch size {p}")
        return run_pixart(self.transformer, x, t.to(torch.float32) * TIME_SCALE, context, context_mask,
                          image_size=self.cfg.image_size)
