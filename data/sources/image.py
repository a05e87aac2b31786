"""Images for `make_shards images` (and the images inside `make_shards conversations`).

Sample format:
    __key__  "{input index:09d}"
    jpg|png  the image: shorter side to --size (LANCZOS), centre crop unless --crop none, RGB,
             JPEG at --quality with 4:4:4 chroma (>= 90) or PNG
    txt      caption (same-stem .txt sidecar, or the manifest's caption/text column)
    json     {"source", "original_size" [w, h], "size" [w, h], ...manifest extras}
Missing, unreadable (also truncated) or below --min-size images are skipped with the reason.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

from PIL import Image, ImageOps

from data.sources.common import Item, media_items

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def image_items(path: str) -> Iterator[Item]:
    """Images: metadata.jsonl folder, sidecar folder, or .csv/.parquet/.jsonl manifest."""
    return media_items(path, IMAGE_EXTS, "image")


@dataclass(frozen=True)
class ImageOpts:
    size: int = 256
    crop: str = "center"
    fmt: str = "jpg"
    quality: int = 95
    min_size: int = 0


def _transform(im: Image.Image, opts: ImageOpts) -> Image.Image | None:
    """Shorter side to opts.size, then optional centre crop; None when below opts.min_size."""
    w, h = im.size
    if min(w, h) < opts.min_size:
        return None
    if opts.size > 0:
        s = opts.size / min(w, h)
        nw, nh = max(opts.size, round(w * s)), max(opts.size, round(h * s))
        if (nw, nh) != (w, h):
            # reducing_gap: a cheap integer pre-shrink before the LANCZOS pass, same quality.
            im = im.resize((nw, nh), Image.LANCZOS, reducing_gap=3.0)
        if opts.crop == "center":
            left, top = (nw - opts.size) // 2, (nh - opts.size) // 2
            im = im.crop((left, top, left + opts.size, top + opts.size))
    return im


def process_image(item: Item, opts: ImageOpts) -> tuple[Item, dict | None]:
    """Decode, resize, crop, re-encode one item; returns (item, sample) or (item with error, None).

    Runs in worker processes: everything it needs travels in its arguments, and it never raises.
    """
    if item.error:
        return item, None
    try:
        if item.data is None and not os.path.isfile(item.source):
            item.error = "missing file"
            return item, None
        src = io.BytesIO(item.data) if item.data is not None else item.source
        with Image.open(src) as im:
            im.load()  # force the full decode here: truncated files fail now, not in training
            im = ImageOps.exif_transpose(im)  # phone photos store rotation in EXIF only
            orig = im.size
            im = im.convert("RGB")  # palettes, alpha, CMYK, 16-bit: one layout for training
    except Exception as e:  # PIL raises many types for bad data; all mean "unreadable"
        item.error = f"unreadable image: {type(e).__name__}: {e}"
        return item, None
    try:
        im = _transform(im, opts)
        if im is None:
            item.error = f"too small: {orig[0]}x{orig[1]} < --min-size {opts.min_size}"
            return item, None
        buf = io.BytesIO()
        if opts.fmt == "png":
            im.save(buf, format="PNG", compress_level=6)
        else:  # 4:4:4 chroma at high quality: thin coloured edges survive re-encoding
            im.save(buf, format="JPEG", quality=opts.quality, subsampling=0 if opts.quality >= 90 else 2)
    except Exception as e:  # e.g. MemoryError on a giant image: skip it, keep the run alive
        item.error = f"transform failed: {type(e).__name__}: {e}"
        return item, None
    w, h = orig
    meta = {"source": item.source, "original_size": [w, h], "size": list(im.size), **item.extra}
    sample = {
        "__key__": f"{item.index:09d}",
        opts.fmt: buf.getvalue(),
        "txt": item.caption,
        "json": json.dumps(meta, sort_keys=True),
    }
    return item, sample


class ImageWork:
    """Picklable callable binding the options, for Pool.imap."""

    def __init__(self, opts: ImageOpts):
        self.opts = opts

    def __call__(self, item: Item):
        return process_image(item, self.opts)
