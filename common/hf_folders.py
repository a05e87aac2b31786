"""Weights in local Hugging Face model folders (diffusers and transformers layouts).

Stable Diffusion's published folders often hold only a precision variant of a component's
weights (`diffusion_pytorch_model.fp16.safetensors`, `model.fp16.safetensors`), which
`from_pretrained` does not read unless told the variant's name.
"""
from __future__ import annotations

import os
import re

# What diffusers and transformers name a component's weights file (before shard and variant parts).
WEIGHT_STEMS = ("diffusion_pytorch_model", "model", "pytorch_model", "flax_model", "tf_model")
_SHARD = re.compile(r"-\d+-of-\d+$")
_FORMAT_PARTS = {"safetensors", "bin", "index", "json", "h5", "msgpack", "ckpt"}


def weights_variant(folder: str) -> str | None:
    """The variant `from_pretrained` needs for `folder`: None when it holds weights under the plain
    names (or none at all, or several variants: from_pretrained then names what is missing), else
    its one variant, e.g. "fp16"."""
    plain, variants = False, set()
    for name in os.listdir(folder):
        parts = name.split(".")
        if _SHARD.sub("", parts[0]) not in WEIGHT_STEMS or len(parts) < 2:
            continue
        rest = {_SHARD.sub("", p) for p in parts[1:]} - _FORMAT_PARTS
        if not rest:
            plain = True
        elif len(rest) == 1:
            variants |= rest
    return None if plain or len(variants) != 1 else variants.pop()
