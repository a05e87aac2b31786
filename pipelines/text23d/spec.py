"""The text23d pipeline contract (common/pipeline.py): what the shared entrypoints run."""
from __future__ import annotations

from common.nn.dit_parallel import parallelize_dit
from common.parallel.parallel_model import parallelize_data_only
from common.pipeline import PipelineSpec
from pipelines.text23d import components as C
from pipelines.text23d.config import T3DConfig
from pipelines.text23d.model import ShapeVAE


def parallelize(model, cfg, info, **kw):
    """The flow transformers take every DiT layout (CP shards the point / latent tokens); the VAE is
    data parallel only (DDP, or FSDP with each attention block a unit)."""
    if isinstance(model, ShapeVAE):
        return parallelize_data_only(model, cfg, info, units=model.blocks(), **kw)
    return parallelize_dit(model, cfg, info, **kw)


SPEC = PipelineSpec(
    name="text23d",
    description="Train a text-to-3D model: a point-cloud flow (stage points), a shape VAE (stage vae) or a "
                "latent flow on a trained VAE (stage latent).",
    config=T3DConfig,
    build=C.build,
    step_fns=C.make_step_fns,
    parallelize=parallelize,
    decoder=C.decoder,
    signature=C.signature,
    generate=C.generate,
    write_grid=C.write_grid,
    write_item=C.write_item,
    describe=C.describe,
    flops=C.flops,
    init=C.measure_latent_scale,
    sample_hook=C.sample_hook,
    media_noun="shapes",
)
