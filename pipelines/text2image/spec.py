"""The text2image pipeline contract (common/pipeline.py): what the shared entrypoints run."""
from __future__ import annotations

import os

from torch import nn

from common.config import ConfigError
from common.data.images import ImageDecoder
from common.diffusion.text_conditioned import text_diffusion_spec
from common.nn.dit_parallel import apply_block_options, parallelize_dit
from common.parallel.data_parallel import apply_data_parallel
from common.parallel.dims import ParallelDims
from common.parallel.layouts import check_layout
from common.parallel.parallel_model import ParallelModel
from pipelines.text2image import components
from pipelines.text2image.config import T2IConfig
from pipelines.text2image.pixart import PixArt
from pipelines.text2image.sd3 import SD3
from pipelines.text2image.unet import UNet


def decoder(comp: components.Components) -> ImageDecoder:
    cfg = comp.cfg
    if cfg.data.buckets:
        raise ConfigError("data.buckets: text2image trains at one resolution (model.image_size); buckets are for "
                          "pipelines with variable shapes")
    return ImageDecoder(cfg.model.image_size, use_latents=bool(cfg.vae.path), text_features=cfg.data.text_features)


def parallelize_diffusers_model(model: UNet | PixArt | SD3, cfg, info, *, microbatches: int = 1, criterion=None,
                                name: str | None = None) -> ParallelModel:
    """The plan of the diffusers-backed denoisers (the UNet, the PixArt and SD3 transformers): data
    parallelism only (parallel_limits refuses tp, cp and pp). Activation checkpointing and compile
    per block (the UNet's resolution blocks down..., mid, up...; the transformers' blocks), then
    DDP, or FSDP2 with each of those blocks a unit and the root owning the input and output layers
    and the time and text embeddings: the DiT's order (AC, compile, fully_shard per block, then the root)."""
    dims = ParallelDims.from_config(cfg, info.world_size)
    arch = "unet" if isinstance(model, UNet) else "pixart" if isinstance(model, PixArt) else "sd3"
    check_layout(dims, cfg, model.parallel_limits(), f"{name or 'text2image'} with model.arch={arch}")
    blocks = nn.ModuleList(model.blocks)  # a view: the blocks stay registered under the diffusers model only
    apply_block_options(blocks, cfg)
    mesh = dims.build_mesh(info.device.type)
    return ParallelModel(apply_data_parallel(model, list(blocks), mesh, dims, info, cfg), dims, mesh)


def parallelize(model, cfg, info, **kwargs) -> ParallelModel:
    """model.arch: the diffusers-backed denoisers' plan or the DiT family's (common/nn/dit_parallel.py)."""
    plan = parallelize_diffusers_model if isinstance(model, (UNet, PixArt, SD3)) else parallelize_dit
    return plan(model, cfg, info, **kwargs)


def describe(comp: components.Components) -> str:
    if isinstance(comp.model, UNet):
        c = comp.model.cfg
        return (f"UNet {comp.cfg.model.preset} (diffusers UNet2DConditionModel), {c.in_channels}x{c.img_size}x"
                f"{c.img_size} input, {comp.num_tokens} positions/sample")
    if isinstance(comp.model, PixArt):
        c = comp.model.cfg
        return (f"PixArt {comp.cfg.model.preset} (diffusers PixArtTransformer2DModel, hidden {c.hidden}, depth "
                f"{c.depth}), {comp.num_tokens} tokens/sample")
    if isinstance(comp.model, SD3):
        c = comp.model.cfg
        return (f"SD3 {comp.cfg.model.preset} (diffusers SD3Transformer2DModel, hidden {c.hidden}, depth {c.depth}), "
                f"{comp.num_tokens} tokens/sample")
    return f"DiT, {comp.num_tokens} tokens/sample"


def init_model(comp: components.Components) -> None:
    """model.init_from: weights from a run, checkpoint or exported folder, before training (a
    resume loads its checkpoint over them)."""
    if comp.cfg.model.init_from:
        from pipelines.text2image.diffusers_pipeline import init_from
        what = init_from(comp, comp.cfg.model.init_from)
        if os.environ.get("RANK", "0") == "0":
            print(f"model.init_from: {what}", flush=True)


SPEC = text_diffusion_spec(
    components,
    name="text2image",
    description="Train a text-to-image DiT, UNet, PixArt or SD3 transformer.",
    config=T2IConfig,
    parallelize=parallelize,
    decoder=decoder,
    write_grid=components.write_grid,
    write_item=components.write_image,
    describe=describe,
    media_noun="images",
    init=init_model,
)
