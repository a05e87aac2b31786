"""The text2image pipeline contract (common/pipeline.py): what the shared entrypoints run."""
from __future__ import annotations

from common.config import ConfigError
from common.data.images import ImageDecoder
from common.diffusion.text_conditioned import text_diffusion_spec
from common.nn.dit_parallel import parallelize_dit
from pipelines.text2image import components
from pipelines.text2image.config import T2IConfig


def decoder(comp: components.Components) -> ImageDecoder:
    cfg = comp.cfg
    if cfg.data.buckets:
        raise ConfigError("data.buckets: text2image trains at one resolution (model.image_size); buckets are for "
                          "pipelines with variable shapes")
    return ImageDecoder(cfg.model.image_size, use_latents=bool(cfg.vae.path))


SPEC = text_diffusion_spec(
    components,
    name="text2image",
    description="Train a text-to-image DiT.",
    config=T2IConfig,
    parallelize=parallelize_dit,
    decoder=decoder,
    write_grid=components.write_grid,
    write_item=components.write_image,
    describe=lambda comp: f"DiT, {comp.num_tokens} tokens/sample",
    media_noun="images",
)
