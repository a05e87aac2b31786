"""Image decoding for training (shard sample -> tensors) and image grids for samples.

Any exception in a decoder marks the sample corrupt: the loader skips it and counts it.
"""
from __future__ import annotations

import io
import math
import os

import numpy as np
import torch
from PIL import Image

from common.data.captions import caption_of, precomputed_text_features

IMAGE_EXTS = ("png", "jpg", "jpeg", "webp")


def image_bytes(sample: dict) -> bytes | None:
    """The raw bytes of the sample's first image extension, None without one."""
    return next((sample[e] for e in IMAGE_EXTS if e in sample), None)


def open_rgb(raw: bytes) -> Image.Image:
    """Encoded image bytes -> a fully decoded RGB PIL image (a truncated file fails here, not later)."""
    img = Image.open(io.BytesIO(raw))
    img.load()
    return img.convert("RGB")


class ImageDecoder:
    """Picklable (loader workers receive it): image -> (3, S, S) float in [-1, 1] (scaled to
    cover, centre-cropped), caption str; `latent` instead of the image when use_latents and the
    sample has a precomputed `latent.npy`; with text_features, `text_features`: the sample's
    precomputed caption features or None (common.data.captions.precomputed_text_features)."""

    def __init__(self, image_size: int, use_latents: bool = False, text_features: bool = False):
        self.image_size = image_size
        self.use_latents = use_latents
        self.text_features = text_features

    def _image(self, raw: bytes) -> torch.Tensor:
        img = open_rgb(raw)
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
        out = {"caption": caption_of(sample)}
        if self.text_features:
            out["text_features"] = precomputed_text_features(sample)
        if self.use_latents and "latent.npy" in sample:
            out["latent"] = torch.from_numpy(np.load(io.BytesIO(sample["latent.npy"])).astype(np.float32))
            return out
        raw = image_bytes(sample)
        if raw is None:
            raise ValueError(f"sample has no image (looked for {', '.join(IMAGE_EXTS)})")
        out["image"] = self._image(raw)
        return out


def tile(clips: torch.Tensor, cols: int | None = None, border: int = 2) -> np.ndarray:
    """uint8 (N, T, H, W, 3) -> one uint8 (T, H', W', 3) clip with the N clips tiled on a white grid
    (an image grid is the T = 1 case)."""
    n, t, h, w, _ = clips.shape
    cols = cols or math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    grid = np.full((t, rows * (h + border) + border, cols * (w + border) + border, 3), 255, dtype=np.uint8)
    arr = clips.numpy()
    for i in range(n):
        r, c = divmod(i, cols)
        y, x = border + r * (h + border), border + c * (w + border)
        grid[:, y:y + h, x:x + w] = arr[i]
    return grid


def save_grid(images: torch.Tensor, path: str, cols: int | None = None, scale: int = 1) -> None:
    """Tile uint8 (N, H, W, 3) images into one PNG, upscaled by `scale` (nearest) for viewing."""
    img = Image.fromarray(tile(images[:, None], cols)[0])
    if scale > 1:
        img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    img.save(path)
