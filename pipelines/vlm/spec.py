"""The vlm pipeline contract (common/pipeline.py): what the shared train entrypoint runs. Sampling
and evaluation are this pipeline's own commands (sample.py, eval.py: answers, not media)."""
from __future__ import annotations

from common.pipeline import PipelineSpec
from pipelines.vlm import components as C
from pipelines.vlm.config import VLMConfig

SPEC = PipelineSpec(
    name="vlm",
    description="Train a vision-language model: CLIP stage 0, then ViT + projector + Llama in stages.",
    config=VLMConfig,
    build=C.build,
    step_fns=C.step_fns,
    parallelize=C.parallelize,
    decoder=C.decoder,
    signature=C.signature,
    describe=C.describe,
    flops=C.flops,
    collate=C.collate,
    init=C.init_from_previous,
    sample_hook=C.sample_hook,
    media_noun="answers",
)
