"""Sample decoding for text2video: shard sample (bytes per extension) -> tensors.

Output: {"video": (C, T, H, W) float in [-1, 1], "caption": str}: channels first, so the
collated batch is (B, C, T, H, W), the VideoDiT's input layout. Sources, in order:
  npy   lossless uint8 (T, H, W, 3) frames (data.synth --video --format npy|both)
  mp4   an encoded clip (data.sources.video / data.synth), via common.data.media.decode_video
  png/jpg/...  an image, as a one-frame video (T = 1) for joint image-video training
A `__bucket__` (frames, h, w) set by the loader overrides the clip shape. Any exception marks
the sample corrupt: the loader skips it and counts it.
"""
from __future__ import annotations

import io

import numpy as np
import torch

from common.data.captions import caption_of, precomputed_text_features
from common.data.images import IMAGE_EXTS, image_bytes
from common.data.media import decode_video


def _resize_frames(video: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """(T, C, h, w) float -> (T, C, H, W): scale to cover keeping the aspect, centre crop."""
    from common.data.buckets import resize_crop
    return video if tuple(video.shape[-2:]) == tuple(size) else resize_crop(video, *size)


class ClipDecoder:
    """Picklable (loader workers receive it). frames, size (int: square, or (h, w)): the clip
    shape the model trains on."""

    def __init__(self, frames: int, size, source: str = "auto", images: bool = True, text_features: bool = False):
        if source not in ("auto", "mp4", "npy"):
            raise ValueError(f"source must be auto, mp4 or npy, got {source!r}")
        self.frames, self.size, self.source, self.images = frames, size, source, images
        self.text_features = text_features  # also return the sample's precomputed caption features (or None)

    def _npy(self, raw: bytes, frames: int, size: tuple[int, int]) -> torch.Tensor:
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
        if arr.ndim != 4 or arr.shape[-1] != 3 or arr.dtype != np.uint8:
            raise ValueError(f"npy frames must be uint8 (T, H, W, 3), got {arr.dtype} {arr.shape}")
        if arr.shape[0] < frames:
            raise ValueError(f"npy clip has {arr.shape[0]} frames, {frames} requested")
        video = torch.from_numpy(arr[:frames].copy()).permute(0, 3, 1, 2).float().div_(127.5).sub_(1.0)
        return _resize_frames(video, size)

    def _image(self, raw: bytes, size: tuple[int, int]) -> torch.Tensor:
        from PIL import Image
        img = Image.open(io.BytesIO(raw))
        img.load()
        arr = torch.from_numpy(np.asarray(img.convert("RGB"), dtype=np.uint8).copy()).permute(2, 0, 1)
        return _resize_frames(arr.float().div_(127.5).sub_(1.0)[None], size)

    def __call__(self, sample: dict) -> dict:
        text = caption_of(sample)
        frames = self.frames
        size = (self.size, self.size) if isinstance(self.size, int) else tuple(self.size)
        bucket = sample.get("__bucket__")
        if bucket is not None:
            frames, size = int(bucket[0]), (int(bucket[1]), int(bucket[2]))
        if "npy" in sample and self.source in ("auto", "npy"):
            video = self._npy(sample["npy"], frames, size)
        elif "mp4" in sample and self.source in ("auto", "mp4"):
            video = decode_video(sample["mp4"], frames, size)
        elif self.images and any(e in sample for e in IMAGE_EXTS):
            if frames != 1 and bucket is None:
                # Without buckets every batch must hold model.frames frames; an image cannot.
                raise ValueError(f"an image sample in a {frames}-frame batch (joint training needs data.buckets)")
            video = self._image(image_bytes(sample), size)
        else:
            wanted = {"auto": "npy or mp4", "mp4": "mp4", "npy": "npy"}[self.source]
            raise ValueError(f"sample has no video ({wanted})")
        out = {"video": video.permute(1, 0, 2, 3).contiguous(), "caption": text}
        if self.text_features:
            out["text_features"] = precomputed_text_features(sample)
        return out
