"""Stable Diffusion 3-style text-to-image transformer (MMDiT): diffusers' `SD3Transformer2DModel`
behind the DiT's interface (pipelines/text2image/model.py), so the text towers, objectives, EMA,
checkpoints, sampling and data parallelism of the pipeline apply unchanged, and SD3-layout
transformer folders can be fine-tuned (model.preset=folder). Architecture only.

SD3 forward: x -> patch embedding + 2-D sin-cos positions (cropped from a table of
             pos_embed_max_size a side); caption tokens -> linear. Both streams go through N joint
             blocks: one attention over the image and caption tokens together, each stream with its
             own adaLN-modulated norms, projections and MLP (the last block updates the image
             stream only) -> adaLN final norm -> linear -> unpatchify.
             t in [0, 1] -> t * 1000 -> sinusoid -> MLP, plus an MLP of a pooled caption vector.
Conditioning comes from the run's text tower. SD3's own stack (text.hf_path = an SD3 pipeline
folder: common.nn.text_encoder.SD3TextEncoders) gives what SD3 was trained on: CLIP-L + CLIP-G +
T5-XXL tokens as the caption stream and the pooled CLIP-L + CLIP-G vector (in the first row of its
output; pooled_dim > 0). Any other tower's token features are the caption stream (every position,
padding included, as SD3 attends to its padded prompts) and their mean over the caption's real
tokens is the pooled vector (pooled_dim = 0). A folder is read when its pooled width is the one
the run's tower gives, and refused naming both otherwise.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from common.nn.dit import masked_mean, preset_config
from pipelines.text2image.diffusers_transformer import DiffusersTransformer, config_mismatch, init_params
from pipelines.text2image.unet import _plain

# SD3's timestep scale: the flow-matching sigma in [0, 1] times 1000, which is this pipeline's t.
TIME_SCALE = 1000.0
CLASS_NAME = "SD3Transformer2DModel"


@dataclass
class SD3Config:
    img_size: int = 32           # model-input (pixel or latent) side
    in_channels: int = 3
    patch_size: int = 4
    text_dim: int = 128          # the text tower's width: caption tokens and the pooled vector
    text_len: int = 32           # used by the FLOP count only
    hidden: int = 128
    depth: int = 4
    heads: int = 4
    qk_norm: str | None = None   # "rms_norm" (SD3.5) or None (SD3)
    # 0: the pooled vector is the mean of the caption tokens (text_dim wide). > 0: SD3's text stack,
    # whose first caption row carries the pooled CLIP vector in its first pooled_dim features.
    pooled_dim: int = 0
    # Further SD3Transformer2DModel arguments over those the fields above give: a folder's settings
    # (preset "folder") that they do not cover, e.g. sample_size, pos_embed_max_size, dual attention.
    extra: dict = field(default_factory=dict)


_PRESETS = {
    # The DiT demo's size: 32 px pixels in 64 tokens of patch 4, width 128, 4 joint blocks, QK RMS-norm.
    "tiny": dict(patch_size=4, hidden=128, depth=4, heads=4, qk_norm="rms_norm"),
    # SD3 Medium's transformer (24 joint blocks of 24 heads x 64 over 128 x 128 x 16 latents), with the
    # run's text tower for its caption and pooled inputs (text.width=4096 for T5-XXL features).
    "medium": dict(img_size=128, in_channels=16, patch_size=2, text_dim=4096, text_len=256, hidden=1536, depth=24,
                   heads=24, extra={"pos_embed_max_size": 192}),
}

PARALLEL_LIMITS = {
    "tp": "the SD3 transformer (diffusers' modules) has no tensor-parallel plan; use data parallelism "
          "(parallel.dp_mode=fsdp or ddp), or model.arch=dit for tp",
    "cp": "the SD3 transformer's joint attention is diffusers' own, with no sequence-sharded path; use data "
          "parallelism, or model.arch=dit for cp",
    "pp": "pipeline stages are not built for the SD3 transformer; use data parallelism, or model.arch=dit for pp",
}


def sd3_config(name: str, **overrides) -> SD3Config:
    return preset_config(SD3Config, _PRESETS, name, **overrides)


def _init_params() -> dict:
    from diffusers import SD3Transformer2DModel
    return init_params(SD3Transformer2DModel)


def diffusers_kwargs(cfg: SD3Config) -> dict:
    """SD3Transformer2DModel's constructor arguments for `cfg`."""
    if cfg.hidden % cfg.heads:
        raise ValueError(f"SD3 hidden={cfg.hidden} is not divisible by heads={cfg.heads}")
    kw = dict(sample_size=cfg.img_size, patch_size=cfg.patch_size, in_channels=cfg.in_channels, num_layers=cfg.depth,
              attention_head_dim=cfg.hidden // cfg.heads, num_attention_heads=cfg.heads,
              joint_attention_dim=cfg.text_dim, caption_projection_dim=cfg.hidden,
              pooled_projection_dim=cfg.pooled_dim or cfg.text_dim,
              out_channels=cfg.in_channels,
              # a table exactly the input's patch grid unless a folder or preset says otherwise
              pos_embed_max_size=cfg.img_size // cfg.patch_size, qk_norm=cfg.qk_norm)
    return {**kw, **cfg.extra}


def sd3_config_from_diffusers(config: dict, *, img_size: int, in_channels: int, text_dim: int, text_len: int,
                              pooled_dim: int = 0) -> SD3Config:
    """The SD3Config of a diffusers SD3Transformer2DModel config (its folder's config.json), for a run
    whose model input is in_channels x img_size^2 and whose text tower is text_dim wide (with a
    pooled_dim-wide pooled vector: SD3's text stack; 0: any other tower). Raises ValueError, naming
    the setting, for a transformer this pipeline cannot drive."""
    if config.get("_class_name", CLASS_NAME) != CLASS_NAME:
        raise ValueError(f"it holds a {config['_class_name']}, not a {CLASS_NAME}")
    params = _init_params()
    given = {k: v for k, v in config.items() if k in params}
    s = {k: given.get(k, p.default) for k, p in params.items()}
    out = s["out_channels"] if s["out_channels"] is not None else s["in_channels"]
    if s["in_channels"] != in_channels or out != in_channels:
        raise ValueError(f"it maps {s['in_channels']} to {out} channels, while this run's model input has "
                         f"{in_channels} (pixels: 3; latents: the VAE's channels, vae.path)")
    if s["joint_attention_dim"] != text_dim:
        raise ValueError(f"its caption width (joint_attention_dim) is {s['joint_attention_dim']}, while "
                         f"text.width={text_dim}")
    if pooled_dim and s["pooled_projection_dim"] != pooled_dim:
        raise ValueError(f"its pooled_projection_dim is {s['pooled_projection_dim']}, while the CLIP encoders of "
                         f"text.hf_path give a pooled vector of {pooled_dim}")
    if not pooled_dim and s["pooled_projection_dim"] != text_dim:
        raise ValueError(f"its pooled_projection_dim is {s['pooled_projection_dim']}, while the pooled vector of this "
                         f"text tower is the mean of its features (text.width={text_dim}); for SD3's own pooled CLIP "
                         "features set text.hf_path to the SD3 pipeline folder (its three text encoders)")
    hidden = s["num_attention_heads"] * s["attention_head_dim"]
    if s["caption_projection_dim"] != hidden:
        raise ValueError(f"caption_projection_dim={s['caption_projection_dim']} differs from its width "
                         f"{s['num_attention_heads']} x {s['attention_head_dim']}")
    if img_size % s["patch_size"]:
        raise ValueError(f"the model input side {img_size} is not divisible by its patch_size={s['patch_size']}")
    if s["pos_embed_max_size"] is not None and img_size // s["patch_size"] > s["pos_embed_max_size"]:
        raise ValueError(f"its position table covers {s['pos_embed_max_size']} patches a side, fewer than the "
                         f"{img_size // s['patch_size']} of a {img_size} model input")
    fields = dict(img_size=img_size, in_channels=in_channels, patch_size=s["patch_size"], text_dim=text_dim,
                  text_len=text_len, hidden=hidden, depth=s["num_layers"], heads=s["num_attention_heads"],
                  qk_norm=s["qk_norm"], pooled_dim=pooled_dim)
    built = diffusers_kwargs(SD3Config(**fields))
    # Every other setting of the folder (sample_size and pos_embed_max_size, which place the
    # position table; dual attention layers, ...) passed on as it is: the same network.
    extra = {k: v for k, v in given.items() if _plain(v) != _plain(built[k] if k in built else params[k].default)}
    return SD3Config(**fields, extra=extra)


def diffusers_config_mismatch(transformer: nn.Module, config: dict) -> list[str]:
    """The init settings in a folder's `config` that the built `transformer` does not have: empty
    when the two are the same architecture."""
    return config_mismatch(transformer, config, _init_params())


def signature_fields(cfg: SD3Config) -> dict:
    """The config as checkpoints record it (common.checkpoint compares it before loading)."""
    return {"arch": "sd3", **dataclasses.asdict(cfg)}


class SD3(DiffusersTransformer):
    """The text2image model interface on a diffusers SD3Transformer2DModel (held as `transformer`)."""

    PARALLEL_LIMITS = PARALLEL_LIMITS

    def __init__(self, cfg: SD3Config):
        from diffusers import SD3Transformer2DModel  # lazily: DiT-only runs do not import diffusers
        super().__init__(cfg, SD3Transformer2DModel(**diffusers_kwargs(cfg)))

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                context_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, C, H, W); t (B,) in [0, 1] (0 = data); context (B, L, text_dim) (with pooled_dim, its
        first row the pooled vector); context_mask (B, L) bool True = real token (used by the mean
        pooled vector only). Returns (B, C, H, W)."""
        p = self.cfg.patch_size
        if x.shape[-2] % p or x.shape[-1] % p:
            raise ValueError(f"SD3 input {tuple(x.shape[-2:])} is not divisible by its patch size {p}")
        context = context.to(x.dtype)
        if self.cfg.pooled_dim:
            pooled, context = context[:, 0, :self.cfg.pooled_dim], context[:, 1:]
        else:
            pooled = masked_mean(context, context_mask)
        return self.transformer(hidden_states=x, encoder_hidden_states=context, pooled_projections=pooled,
                                timestep=t.to(torch.float32) * TIME_SCALE, return_dict=False)[0]
