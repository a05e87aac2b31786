"""Sample decoding for text2image: shard sample (bytes per extension) -> tensors.

Any exception here marks the sample corrupt: the loader skips it and counts it.
"""
from __future__ import annotations

import io
import json

import numpy as np
import torch
from PIL import Image

IMAGE_EXTS = ("png", "jpg", "jpeg", "webp")


class ImageDecoder:
    """Picklable (loader workers receive it): image -> (3, S, S) float in [-1, 1], caption str."""

    def __init__(self, image_size: int, use_latents: bool = False):
        self.image_size = image_size
        self.use_latents = use_latents

    def _image(self, raw: bytes) -> torch.Tensor:
        img = Image.open(io.BytesIO(raw))
        img.load()  # force a full decode so truncated files fail here, not later
        img = img.convert("RGB")
        s = self.image_size
        if img.size != (s, s):
            w, h = img.size
            scale = s / min(w, h)
            img = img.resize((max(s, round(w * scale)), max(s, round(h * scale))), Image.BICUBIC)
            left, top = (img.width - s) // 2, (img.height - s) // 2
            img = img.crop((left, top, left + s, top + s))
        arr = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)
        return arr.float().div_(127.5).sub_(1.0)

    def __call__(self, sample: dict) -> dict:
        caption = sample.get("txt")
        if caption is None:
            raise ValueError("sample has no txt caption")
        out = {"caption": caption.decode("utf-8").strip() if isinstance(caption, bytes) else str(caption)}
        if self.use_latents and "latent.npy" in sample:
            out["latent"] = torch.from_numpy(np.load(io.BytesIO(sample["latent.npy"])).astype(np.float32))
            return out
        raw = next((sample[e] for e in IMAGE_EXTS if e in sample), None)
        if raw is None:
            raise ValueError(f"sample has no image (looked for {', '.join(IMAGE_EXTS)})")
        out["image"] = self._image(raw)
        return out


def read_attributes(sample: dict) -> dict:
    raw = sample.get("json")
    return json.loads(raw) if raw else {}


def first_examples(spec: str, n: int) -> list[tuple[str, dict]]:
    """(caption, attributes) of the first n samples of some shards, in shard order (no shuffle):
    the fixed held-out prompts of sample grids and eval."""
    from common.data import ShardIndex, expand_shards
    index = ShardIndex(expand_shards(spec))
    out = []
    for shard_id, size in enumerate(index.shard_sizes):
        for sample_id in range(size):
            if len(out) == n:
                return out
            s = index.read(shard_id, sample_id)
            out.append((s["txt"].decode("utf-8").strip(), read_attributes(s)))
    return out
