"""Shape buckets: every DP rank draws the same bucket at each micro-step, batch size per bucket.

Assignment rule (`Buckets.assign`): a bucket (frames, height, width) *fits* a sample when
frames <= sample frames, height <= sample height and width <= sample width (images have 1
frame), i.e. the sample can be resized/cropped down to it (`resize_crop`) without upsampling in
any dimension beyond a cover-resize. Among fitting buckets the sample goes to the *largest* one
(most frames*height*width); ties go to the bucket whose aspect ratio (w/h, log scale) is closest
to the sample's, then to the lower index. A sample that fits no bucket is skipped and counted.

The bucket of a sample comes from its `json` member (`width`/`height`/`frames`, or
`size: [w, h]`, `num_frames`), never from decoding media: `assign_index` reads only that small
member of every sample once at start (one pread per sample, a progress bar; ~N small reads,
seconds per million samples on local disk) and keeps one int16 per sample.

Schedule (`BucketPlanner`): micro-step t draws bucket k from a generator seeded by (seed, t),
with probability proportional to (share of the mixture in bucket k) / (batch size of k), so all
buckets drain at the rate they occur. Bucket k's stream is the sub-sequence of global positions
(the mixed, position-addressable order) whose sample is in bucket k; the step takes the next
dp_size * B_k positions of that stream and rank r keeps the r-th block of B_k. State = (step,
per-bucket cursor = next global position to scan, per-bucket consumed count): a pure description
of what has been consumed, independent of dp_size, so a resume on another DP degree continues
every bucket stream exactly where it stopped (no sample repeated or skipped).
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .shards import DataError, ShardIndex


_TAG_BUCKET = 0x5EED_0006
Shape = tuple[int, int, int]  # (frames, height, width)


def pixels(shape: Shape) -> int:
    f, h, w = shape
    return f * h * w


class Buckets:
    """Bucket shapes ((h, w) or (frames, h, w)) and a per-rank token budget per micro-batch.

    `batch_size(k) = max(1, target_tokens // tokens(shape_k))`; `tokens` defaults to
    frames*height*width (pixels); pass e.g. `lambda s: s[0] * (s[1] // 16) * (s[2] // 16)`.
    """

    def __init__(self, shapes: Sequence[Sequence[int]], target_tokens: int,
                 tokens: Callable[[Shape], int] | None = None):
        if not shapes:
            raise DataError("buckets: need at least one bucket shape")
        norm = []
        for s in shapes:
            s = tuple(int(x) for x in s)
            if len(s) == 2:
                s = (1,) + s
            if len(s) != 3 or min(s) < 1:
                raise DataError(f"bucket shape must be [h, w] or [frames, h, w] of positive ints, got {s}")
            norm.append(s)
        if len(set(norm)) != len(norm):
            raise DataError(f"duplicate bucket shapes in {norm}")
        if int(target_tokens) < 1:
            raise DataError(f"bucket target_tokens must be >= 1, got {target_tokens}")
        self.shapes: list[Shape] = norm
        self.target_tokens = int(target_tokens)
        tokens = tokens or pixels
        self.batch_sizes = [max(1, self.target_tokens // max(1, int(tokens(s)))) for s in norm]

    def __len__(self) -> int:
        return len(self.shapes)

    def signature(self) -> list:
        return [list(s) for s in self.shapes] + [self.batch_sizes]

    def assign(self, shape: Shape | None) -> int:
        """Index of the largest bucket that fits `shape` (frames, h, w), or -1."""
        if shape is None:
            return -1
        f, h, w = shape
        best, best_key = -1, None
        for k, (bf, bh, bw) in enumerate(self.shapes):
            if bf <= f and bh <= h and bw <= w:
                key = (-(bf * bh * bw), abs(math.log((bw / bh) / (w / h))), k)
                if best_key is None or key < best_key:
                    best, best_key = k, key
        return best


def sample_shape(meta: dict) -> Shape | None:
    """(frames, height, width) from a sample's json metadata, or None when it has no size:
    width/height, a [width, height] `size` (make_shards), or a square `image_size` (data.synth,
    whose `size` is a word such as "medium")."""
    try:
        if "width" in meta and "height" in meta:
            w, h = int(meta["width"]), int(meta["height"])
        elif isinstance(meta.get("size"), (list, tuple)):
            w, h = (int(x) for x in meta["size"][:2])
        elif "image_size" in meta:
            w = h = int(meta["image_size"])
        else:
            return None
        f = int(meta.get("frames", meta.get("num_frames", 1)))
    except (TypeError, ValueError):
        return None
    return (f, h, w) if min(f, h, w) >= 1 else None


_ASSIGN_CACHE: dict[tuple, list[np.ndarray]] = {}


def assign_index(index: ShardIndex, buckets: Buckets, progress: bool = True) -> list[np.ndarray]:
    """Per shard, the bucket id (int16, -1 = fits none) of every sample, from its json member."""
    key = (tuple(map(id, index._samples)), tuple(buckets.shapes))  # index lists are cached per file version
    got = _ASSIGN_CACHE.get(key)
    if got is not None:
        return got
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=index.num_samples, desc="bucket index", unit="sample", leave=False)
    out = []
    for sid, samples in enumerate(index._samples):
        ids = np.full(len(samples), -1, dtype=np.int16)
        for i, (_, members) in enumerate(samples):
            span = members.get("json")
            if span is not None:
                off, size = span
                try:
                    meta = json.loads(os.pread(index._fd(sid), size, off))
                    ids[i] = buckets.assign(sample_shape(meta) if isinstance(meta, dict) else None)
                except ValueError:
                    pass  # unreadable metadata: fits no bucket (counted as skipped)
        out.append(ids)
        if bar is not None:
            bar.update(len(samples))
    if bar is not None:
        bar.close()
    _ASSIGN_CACHE[key] = out
    return out


class BucketPlanner:
    """Sequential bucket schedule over a position-addressable order (see module docstring).

    `bucket_of(p)` must return the bucket id of global position p (-1: none).
    """

    def __init__(self, bucket_of: Callable[[int], int], buckets: Buckets, shares: Sequence[float],
                 seed: int, dp_size: int, chunk: int = 1024):
        self.bucket_of, self.buckets, self.seed, self.dp_size = bucket_of, buckets, int(seed), dp_size
        shares = np.asarray(shares, dtype=np.float64)
        if shares.sum() <= 0:
            raise DataError("buckets: no sample fits any bucket (check bucket shapes and the "
                            "json width/height/frames metadata)")
        rate = shares / np.asarray(buckets.batch_sizes, dtype=np.float64)
        self.probs = rate / rate.sum()
        self.cdf = np.cumsum(self.probs)
        self.chunk = int(chunk)
        self._chunks: OrderedDict[int, np.ndarray] = OrderedDict()
        self.step = 0
        self.cursors = [0] * len(buckets)
        self.consumed = [0] * len(buckets)

    # -- state
    def state(self) -> dict:
        return {"step": self.step, "cursors": list(self.cursors), "consumed": list(self.consumed)}

    def load(self, st: dict) -> None:
        if len(st["cursors"]) != len(self.buckets):
            raise DataError(f"bucket state has {len(st['cursors'])} buckets, config has {len(self.buckets)}")
        self.step = int(st["step"])
        self.cursors = [int(x) for x in st["cursors"]]
        self.consumed = [int(x) for x in st["consumed"]]

    # -- schedule
    def bucket_for_step(self, t: int) -> int:
        u = np.random.default_rng([_TAG_BUCKET, self.seed, int(t)]).random()
        k = int(np.searchsorted(self.cdf, u, side="right"))
        while self.probs[min(k, len(self.probs) - 1)] == 0:  # float edge: never a bucket with p=0
            k -= 1
        return min(k, len(self.probs) - 1)

    def _chunk_ids(self, c: int) -> np.ndarray:
        ids = self._chunks.get(c)
        if ids is None:
            base = c * self.chunk
            ids = self._chunks[c] = np.fromiter((self.bucket_of(base + i) for i in range(self.chunk)),
                                                dtype=np.int16, count=self.chunk)
            while len(self._chunks) > 64:
                self._chunks.popitem(last=False)
        else:
            self._chunks.move_to_end(c)
        return ids

    def _take(self, k: int, n: int) -> list[int]:
        got: list[int] = []
        g = self.cursors[k]
        while len(got) < n:
            c, off = divmod(g, self.chunk)
            hits = np.flatnonzero(self._chunk_ids(c)[off:] == k)[: n - len(got)]
            got.extend(int(c * self.chunk + off + h) for h in hits)
            g = got[-1] + 1 if len(got) == n else (c + 1) * self.chunk
        self.cursors[k] = g
        self.consumed[k] += n
        return got

    def next_step(self) -> tuple[int, list[int]]:
        """Advance one micro-step: (bucket id, all dp_size * B_k global positions of the step)."""
        k = self.bucket_for_step(self.step)
        pos = self._take(k, self.dp_size * self.buckets.batch_sizes[k])
        self.step += 1
        return k, pos


def resize_crop(img: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Resize `img` (..., H, W) so it covers (height, width) keeping its aspect, then centre-crop."""
    h, w = img.shape[-2:]
    scale = max(height / h, width / w)
    nh, nw = max(height, round(h * scale)), max(width, round(w * scale))
    if (nh, nw) != (h, w):
        lead = img.shape[:-2]
        x = img.reshape(-1, 1, h, w).float()
        x = torch.nn.functional.interpolate(x, size=(nh, nw), mode="bilinear", antialias=True,
                                            align_corners=False)
        img = x.reshape(*lead, nh, nw).to(img.dtype) if img.is_floating_point() else \
            x.round().clamp(0, 255).reshape(*lead, nh, nw).to(img.dtype)
    top, left = (nh - height) // 2, (nw - width) // 2
    return img[..., top: top + height, left: left + width]
