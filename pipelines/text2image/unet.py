"""Stable-Diffusion-style text-to-image UNet: diffusers' `UNet2DConditionModel` behind the DiT's
interface (pipelines/text2image/model.py), so the text towers, objectives, EMA, checkpoints,
sampling and data parallelism of the pipeline apply unchanged. Architecture only.

UNet forward:  x -> conv_in -> down blocks (ResNet [+ transformer: self-attn, cross-attn to the
               text tokens, GEGLU MLP], then downsample) -> mid block -> up blocks (skip
               connections from the down path) -> GroupNorm, SiLU, conv_out
               t in [0, 1] -> t * 1000 -> sinusoid -> MLP -> added in every ResNet
               [pooled_text: masked mean of the text tokens -> MLP -> added to the same embedding]
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from common.metrics import meta_forward_flops
from common.nn.dit import masked_mean, preset_config

# The timestep scale of the SD family (1000 DDPM steps): t in [0, 1] becomes t * 1000, so the
# DDPM objective's t / T maps back onto its integer timesteps and flow matching spans the same range.
TIME_SCALE = 1000.0


@dataclass
class UNetConfig:
    img_size: int = 32           # model-input (pixel or latent) side; used by the FLOP count only
    in_channels: int = 3
    # Space-to-depth before the UNet (pixel_unshuffle; pixel_shuffle after): p x p pixels become
    # one position of p^2 * C channels. 1 for latents (the VAE already downsampled); 2 for 32 px
    # pixels on a CPU, where full-resolution 3x3 convolutions would dominate the step time.
    patch_size: int = 1
    text_dim: int = 128          # cross_attention_dim: the text tower's width
    text_len: int = 32           # used by the FLOP count only
    # Per resolution level, from the input resolution down (lists, not tuples: the checkpoint
    # signature is compared with its JSON copy).
    channels: list[int] = field(default_factory=lambda: [32, 64, 64])
    attention: list[bool] = field(default_factory=lambda: [False, True, True])  # transformer at this level
    heads: list[int] = field(default_factory=lambda: [4, 4, 4])
    transformer_layers: list[int] = field(default_factory=lambda: [1, 1, 1])
    layers_per_block: int = 1
    norm_groups: int = 8
    linear_projection: bool = False  # transformer proj_in/out as linears (SDXL) instead of 1x1 convs (SD1.x)
    # Masked mean of the text tokens added to the timestep embedding (SDXL's pooled text embedding,
    # as the DiT's pooled_text), so every ResNet sees the caption, not only the attention levels.
    pooled_text: bool = True
    # Padded caption tokens masked out of cross-attention. SD1.x / 2.x were trained attending to all
    # 77 CLIP positions, padding included, so a UNet read from their folders keeps that (False).
    text_mask: bool = True
    # Further UNet2DConditionModel arguments, over those the fields above give: the settings of a
    # diffusers folder (preset "folder") that they do not cover, e.g. upcast_attention.
    extra: dict = field(default_factory=dict)

    @property
    def levels(self) -> int:
        return len(self.channels)

    @property
    def downsample(self) -> int:
        """What the input side must be divisible by."""
        return self.patch_size * 2 ** (self.levels - 1)


_PRESETS = {
    # 32 px pixels as 16x16 positions of 2x2x3 (patch_size 2): convolutions at 16x16, transformers
    # at 8x8 and 4x4 and in the mid block; ~1.8M params, about the DiT tiny's step time on a CPU
    # (full-resolution 32x32 convolutions cost ~4x more per step).
    "tiny": dict(patch_size=2, channels=[32, 64, 64], attention=[False, True, True], heads=[4, 4, 4],
                 transformer_layers=[1, 1, 1], layers_per_block=1, norm_groups=8, pooled_text=True),
    # SD1.x (CLIP ViT-L/14 text, width 768): 64x64x4 latents for 512 px, 8 heads at every level.
    "sd15": dict(img_size=64, in_channels=4, text_dim=768, text_len=77, channels=[320, 640, 1280, 1280],
                 attention=[True, True, True, False], heads=[8, 8, 8, 8], transformer_layers=[1, 1, 1, 1],
                 layers_per_block=2, norm_groups=32, pooled_text=False),
    # SDXL (two CLIP towers concatenated, width 2048): 128x128x4 latents for 1024 px, no attention
    # at the highest resolution, 2 and 10 transformer layers at the lower ones, head dim 64.
    # Pooled text is the masked token mean (the interface carries tokens only); SDXL's size and
    # crop conditioning is left out.
    "sdxl": dict(img_size=128, in_channels=4, text_dim=2048, text_len=77, channels=[320, 640, 1280],
                 attention=[False, True, True], heads=[5, 10, 20], transformer_layers=[1, 2, 10],
                 layers_per_block=2, norm_groups=32, linear_projection=True, pooled_text=True),
}

# Parallel dimensions the UNet has no plan for, with the reason (its parallel_limits()).
PARALLEL_LIMITS = {
    "tp": "the UNet has no tensor-parallel plan (its convolutions and GroupNorms are not split); use data "
          "parallelism (parallel.dp_mode=fsdp or ddp)",
    "cp": "context parallelism shards a token sequence, while the UNet's convolutions and up/down sampling need "
          "whole feature maps; use data parallelism",
    "pp": "pipeline stages are not built for the UNet (its skip connections cross every stage boundary); use "
          "data parallelism",
}


# model.preset=folder: the architecture of the diffusers UNet in model.init_from (unet_config_from_diffusers).
FOLDER_PRESET = "folder"


def unet_config(name: str, **overrides) -> UNetConfig:
    return preset_config(UNetConfig, _PRESETS, name, **overrides)


_DOWN_TYPES = {"CrossAttnDownBlock2D": True, "DownBlock2D": False}
_UP_TYPES = {"CrossAttnUpBlock2D": True, "UpBlock2D": False}
# Settings whose conditioning this interface (image, timestep, text tokens) cannot supply, with why.
_UNSUPPORTED = {
    "addition_embed_type": "it needs added conditioning inputs (SDXL's text_time: pooled CLIP-G text and "
                           "size / crop ids); model.preset=sdxl is the SDXL-sized UNet this pipeline trains",
    "encoder_hid_dim": "it projects image or text embeddings through encoder_hid_proj, which this pipeline "
                       "does not feed",
    "time_cond_proj_dim": "it needs a guidance-scale embedding (latent consistency models)",
    "num_class_embeds": "it needs class labels",
}


def unet_config_from_diffusers(config: dict, *, img_size: int, in_channels: int, text_dim: int,
                               text_len: int) -> UNetConfig:
    """The UNetConfig of a diffusers UNet2DConditionModel config (its folder's config.json), for a
    run whose model input is in_channels x img_size^2 and whose text tower is text_dim wide.
    Raises ValueError, naming the setting, for a UNet this pipeline cannot drive as trained."""
    import inspect

    from diffusers import UNet2DConditionModel
    if config.get("_class_name", UNet2DConditionModel.__name__) != UNet2DConditionModel.__name__:
        raise ValueError(f"it holds a {config['_class_name']}, not a UNet2DConditionModel")
    params = inspect.signature(UNet2DConditionModel.__init__).parameters
    given = {k: v for k, v in config.items() if k in params and k != "self"}
    setting = {k: given.get(k, params[k].default) for k in params if k != "self"}
    for key, why in _UNSUPPORTED.items():
        if setting[key] is not None:
            raise ValueError(f"{key}={setting[key]!r} is not supported: {why}")
    if setting["in_channels"] != in_channels or setting["out_channels"] != in_channels:
        raise ValueError(f"it maps {setting['in_channels']} to {setting['out_channels']} channels, while this run's "
                         f"model input has {in_channels} (pixels: 3; latents: the VAE's channels, vae.path)")
    if setting["cross_attention_dim"] != text_dim:
        raise ValueError(f"its cross_attention_dim is {setting['cross_attention_dim']}, while text.width={text_dim} "
                         "(set text.width, and text.hf_path to the text encoder it was trained with)")
    pooled = setting["class_embed_type"]
    if pooled not in (None, "projection") or (pooled and setting["projection_class_embeddings_input_dim"] != text_dim):
        raise ValueError(f"class_embed_type={pooled!r} is not supported (None, or 'projection' from the text "
                         f"width {text_dim}: the pooled caption)")
    down, up = list(setting["down_block_types"]), list(setting["up_block_types"])
    if any(b not in _DOWN_TYPES for b in down) or [_UP_TYPES.get(b) for b in up] != [_DOWN_TYPES[b] for b in reversed(down)]:
        raise ValueError(f"block types {down} / {up} are not the SD layout (CrossAttnDownBlock2D / DownBlock2D, "
                         "mirrored by CrossAttnUpBlock2D / UpBlock2D)")
    if setting["mid_block_type"] != "UNetMidBlock2DCrossAttn":
        raise ValueError(f"mid_block_type={setting['mid_block_type']!r} is not supported (UNetMidBlock2DCrossAttn)")
    n = len(down)

    def per_level(key: str) -> list[int]:
        v = setting[key]
        v = [v] * n if isinstance(v, int) else list(v)
        if len(v) != n or not all(isinstance(x, int) for x in v):
            raise ValueError(f"{key}={setting[key]!r} is not one int per level")
        return v

    if setting["reverse_transformer_layers_per_block"] is not None:
        raise ValueError("reverse_transformer_layers_per_block is not supported")
    fields = dict(img_size=img_size, in_channels=in_channels, patch_size=1, text_dim=text_dim, text_len=text_len,
                  channels=per_level("block_out_channels"), attention=[_DOWN_TYPES[b] for b in down],
                  heads=per_level("attention_head_dim"), transformer_layers=per_level("transformer_layers_per_block"),
                  layers_per_block=setting["layers_per_block"], norm_groups=setting["norm_num_groups"],
                  linear_projection=bool(setting["use_linear_projection"]), pooled_text=pooled == "projection",
                  text_mask=False)
    if not isinstance(fields["layers_per_block"], int):
        raise ValueError(f"layers_per_block={fields['layers_per_block']!r} is not one int")
    built = diffusers_kwargs(UNetConfig(**fields))
    # Everything else the folder sets away from diffusers' default is passed on as it is, and so are
    # per-level settings it gives as one int (SD1.x's attention_head_dim=8): the same network, and
    # the folder's own config.json when the run is exported.
    extra = {k: v for k, v in given.items()
             if (k not in built and k != "sample_size" and _plain(v) != _plain(params[k].default))
             or (k in ("attention_head_dim", "transformer_layers_per_block") and isinstance(v, int))}
    return UNetConfig(**fields, extra=extra)


def _plain(v):
    """A config value as JSON gives it (tuples are lists), for comparing folder and default settings."""
    return [_plain(x) for x in v] if isinstance(v, (list, tuple)) else v


# Fields added after UNet checkpoints were first written, with their defaults: left out of the
# checkpoint signature at these values, so that the earlier checkpoints still load.
_LATER_FIELDS = {"text_mask": True, "extra": {}}


def signature_fields(cfg: UNetConfig) -> dict:
    """The config as checkpoints record it (common.checkpoint compares it before loading)."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if not (k in _LATER_FIELDS and v == _LATER_FIELDS[k])}


def diffusers_config_mismatch(unet: nn.Module, config: dict) -> list[str]:
    """The init settings in a folder's `config` that the built `unet` does not have (sample_size,
    which only sizes sampling defaults, aside): empty when the two are the same architecture."""
    import inspect
    params = inspect.signature(type(unet).__init__).parameters
    return [f"{k}: folder {v!r} vs built {unet.config.get(k)!r}" for k, v in config.items()
            if k in params and k not in ("self", "sample_size") and _plain(v) != _plain(unet.config.get(k))]


def diffusers_kwargs(cfg: UNetConfig) -> dict:
    """UNet2DConditionModel's constructor arguments for `cfg`."""
    n = cfg.levels
    for name in ("attention", "heads", "transformer_layers"):
        if len(getattr(cfg, name)) != n:
            raise ValueError(f"UNet {name} has {len(getattr(cfg, name))} entries for {n} levels (channels)")
    if any(c % cfg.norm_groups for c in cfg.channels):
        raise ValueError(f"UNet channels {cfg.channels} are not all divisible by norm_groups={cfg.norm_groups}")
    if not any(cfg.attention):
        raise ValueError("a text-conditioned UNet needs cross-attention at one level at least")
    down = ["CrossAttnDownBlock2D" if a else "DownBlock2D" for a in cfg.attention]
    up = ["CrossAttnUpBlock2D" if a else "UpBlock2D" for a in reversed(cfg.attention)]
    if cfg.patch_size < 1:
        raise ValueError(f"UNet patch_size={cfg.patch_size} must be >= 1")
    width = cfg.in_channels * cfg.patch_size ** 2
    kw = dict(sample_size=cfg.img_size // cfg.patch_size, in_channels=width, out_channels=width,
              down_block_types=tuple(down), up_block_types=tuple(up), mid_block_type="UNetMidBlock2DCrossAttn",
              block_out_channels=tuple(cfg.channels), layers_per_block=cfg.layers_per_block,
              norm_num_groups=cfg.norm_groups, cross_attention_dim=cfg.text_dim,
              # diffusers' `attention_head_dim` is the number of heads (its documented misnomer)
              attention_head_dim=tuple(cfg.heads), transformer_layers_per_block=tuple(cfg.transformer_layers),
              use_linear_projection=cfg.linear_projection)
    if cfg.pooled_text:
        kw.update(class_embed_type="projection", projection_class_embeddings_input_dim=cfg.text_dim)
    return {**kw, **cfg.extra}


def run_unet(unet: nn.Module, x: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor,
             context_mask: torch.Tensor | None, *, pooled_text: bool, patch_size: int,
             text_mask: bool = True) -> torch.Tensor:
    """A UNet2DConditionModel called as this pipeline trains it (shared with the exported diffusers
    pipeline): timesteps in its units (t * 1000), the masked mean of the text tokens as
    class_labels when pooled_text, padded tokens masked out of cross-attention when text_mask, the
    input space-to-depth by patch_size (pixel_unshuffle before, pixel_shuffle after)."""
    context = context.to(x.dtype)
    pooled = masked_mean(context, context_mask) if pooled_text else None
    # diffusers turns the bool mask into an additive bias of -10000 on masked keys: after the
    # softmax their weight underflows to exactly 0 in fp32 and bf16.
    mask = context_mask.bool() if context_mask is not None and text_mask else None
    p = patch_size
    h = F.pixel_unshuffle(x, p) if p > 1 else x
    h = unet(h, timesteps, encoder_hidden_states=context, encoder_attention_mask=mask, class_labels=pooled,
             return_dict=False)[0]
    return F.pixel_shuffle(h, p) if p > 1 else h


def denoiser_flops(model: nn.Module, height: int | None, width: int | None, text_len: int | None) -> int:
    """Forward FLOPs per sample of a diffusers-backed denoiser (UNet, PixArt): `type(model)(model.cfg)`
    built and run on the meta device, once per (height, width, text_len), cached in model._flops."""
    c = model.cfg
    key = (height or c.img_size, width or c.img_size, text_len or c.text_len)
    if key not in model._flops:
        model._flops[key] = meta_forward_flops(lambda: type(model)(c), lambda: (
            torch.empty(1, c.in_channels, key[0], key[1]), torch.empty(1), torch.empty(1, key[2], c.text_dim),
            torch.ones(1, key[2], dtype=torch.bool)))
    return model._flops[key]


class UNet(nn.Module):
    """The text2image model interface on a diffusers UNet2DConditionModel (held as `unet`, so its
    parameters keep diffusers' names under the `unet.` prefix)."""

    def __init__(self, cfg: UNetConfig):
        super().__init__()
        from diffusers import UNet2DConditionModel  # lazily: DiT-only runs do not import diffusers
        self.cfg = cfg
        self.unet = UNet2DConditionModel(**diffusers_kwargs(cfg))
        self.reset_parameters()
        self._flops: dict[tuple, int] = {}

    def reset_parameters(self) -> None:
        """Zero the last layer of every residual branch and the output conv (as the original
        latent-diffusion UNet does): each ResNet and transformer starts as the identity and the
        untrained model predicts 0, as the DiT (identity blocks, zero final layer)."""
        from diffusers.models.resnet import ResnetBlock2D
        from diffusers.models.transformers.transformer_2d import Transformer2DModel
        zero = [self.unet.conv_out]
        for m in self.unet.modules():
            if isinstance(m, ResnetBlock2D):
                zero.append(m.conv2)
            elif isinstance(m, Transformer2DModel):
                zero.append(m.proj_out)
        for m in zero:
            nn.init.zeros_(m.weight)
            nn.init.zeros_(m.bias)

    @property
    def blocks(self) -> list[nn.Module]:
        """The resolution blocks in forward order (down..., mid, up...): the units of activation
        checkpointing and of FSDP sharding."""
        return [*self.unet.down_blocks, self.unet.mid_block, *self.unet.up_blocks]

    def parallel_limits(self) -> dict[str, str]:
        """{parallel dimension: why the UNet cannot use it} (common/parallel/layouts.py)."""
        return dict(PARALLEL_LIMITS)

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                context_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, C, H, W); t (B,) in [0, 1] (0 = data); context (B, L, text_dim);
        context_mask (B, L) bool True = real token. Returns (B, C, H, W)."""
        if x.shape[-2] % self.cfg.downsample or x.shape[-1] % self.cfg.downsample:
            raise ValueError(f"UNet input {tuple(x.shape[-2:])} is not divisible by its downsampling "
                             f"factor {self.cfg.downsample}")
        return run_unet(self.unet, x, t.to(torch.float32) * TIME_SCALE, context, context_mask,
                        pooled_text=self.cfg.pooled_text, patch_size=self.cfg.patch_size, text_mask=self.cfg.text_mask)

    def flops_per_sample(self, height: int | None = None, width: int | None = None,
                         text_len: int | None = None) -> int:
        """Forward FLOPs per sample (2 per multiply-add) of convolutions, matmuls and attention,
        counted once per shape by torch.utils.flop_counter on a meta-device copy (no compute, the
        weights untouched). Training is about 3x this."""
        return denoiser_flops(self, height, width, text_len)
