"""The text2video pipeline contract (common/pipeline.py): what the shared entrypoints run."""
from __future__ import annotations

import argparse

from common.diffusion.text_conditioned import text_diffusion_spec
from common.nn.dit_parallel import parallelize_dit
from pipelines.text2video import components
from pipelines.text2video.config import T2VConfig
from pipelines.text2video.data import ClipDecoder


def decoder(comp: components.Components) -> ClipDecoder:
    frames, *size = comp.pixel_clip_shape  # pixel clips: a VAE encodes them in prepare
    return ClipDecoder(frames, tuple(size), comp.cfg.video.source, comp.cfg.video.images,
                       text_features=comp.cfg.data.text_features)


def describe(comp: components.Components) -> str:
    mc = comp.model.cfg
    return f"VideoDiT, {mc.num_tokens} tokens/clip ({mc.frames}x{mc.height}x{mc.width}, {mc.attention} attention)"


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 1")
    return int(text)


SPEC = text_diffusion_spec(
    components,
    name="text2video",
    description="Train a text-to-video DiT.",
    config=T2VConfig,
    parallelize=parallelize_dit,
    decoder=decoder,
    write_grid=components.write_grid,
    write_item=components.write_clip,
    describe=describe,
    # Buckets are pixel (frames, h, w); their token count decides the per-bucket batch size.
    bucket_tokens=lambda comp: comp.clip_tokens,
    sample_options=(
        (("--frames",), dict(type=_positive_int, default=None,
                             help="pixel frames per clip (default: the run's model.frames; with a causal video VAE "
                                  "1 + k * its temporal factor, e.g. 5, 9, 17 for Wan)")),
        (("--fps",), dict(type=float, default=None, help="frame rate of the files (default: the run's sample.fps)")),
        (("--scale",), dict(type=int, default=None, help="nearest upscale of the files (default: sample.scale)")),
    ),
    generate_options=("frames",),
    media_noun="clips",
)
