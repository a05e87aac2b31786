"""Video clips for `make_shards videos`, decoded and re-encoded with PyAV.

Sample format (one sample per clip; a video yields up to --clips-per-video clips):

    __key__  "{input index:09d}-{clip:04d}"
    mp4      the clip: H.264 (libx264, CRF --crf, yuv420p, preset veryfast, 1 thread, no B-frames)
             in an MP4 container, or MPEG-4 Part 2 at a fixed qscale when the PyAV build lacks
             libx264; exactly `frames` frames at constant `fps`, height x width pixels
    txt      caption (same-stem .txt sidecar, or the manifest's caption/text column)
    json     {"frames", "fps", "height", "width", "duration" (frames / fps, s), "source",
              "start" (clip start in the source, s), "clip", "codec"}

Clips: the stream is resampled to --fps (each output time takes the latest source frame at or
before it), frames are resized (shorter side to --size, then centre crop unless --crop none;
odd sizes rounded down to even for yuv420p), and clip c covers resampled frames
[c * stride, c * stride + frames) from the start time (manifest `start`, else 0) up to `end`.
A video that yields no complete clip is skipped as "too short".
"""

from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import dataclass

import numpy as np
from PIL import Image

from common.data.media import encode_mp4
from data.sources.common import Item

VIDEO_EXTS = (".mp4", ".webm", ".mkv", ".avi", ".mov", ".m4v", ".mpg", ".mpeg", ".ogv")


@dataclass(frozen=True)
class VideoOpts:
    fps: float = 8.0
    frames: int = 16
    size: int = 256
    crop: str = "center"
    clips_per_video: int = 1  # 0: all clips
    stride: float = 0.0  # seconds between clip starts; 0: clip length (no overlap)
    crf: int = 23


def _resize(im: Image.Image, opts: VideoOpts) -> np.ndarray:
    w, h = im.size
    if opts.size > 0:
        s = opts.size / min(w, h)
        nw, nh = max(opts.size, round(w * s)), max(opts.size, round(h * s))
        im = im.resize((nw, nh), Image.BILINEAR) if (nw, nh) != (w, h) else im
        if opts.crop == "center":
            left, top = (nw - opts.size) // 2, (nh - opts.size) // 2
            im = im.crop((left, top, left + opts.size, top + opts.size))
    w, h = im.size
    arr = np.asarray(im.convert("RGB"))
    return arr[: h - h % 2, : w - w % 2]  # yuv420p needs even sides


def _seconds(v, name: str) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ValueError(f"bad {name} {v!r}") from None


def process_video(item: Item, opts: VideoOpts) -> tuple[Item, list[dict] | None]:
    """All clips of one video; never raises (runs in worker processes)."""
    if item.error:
        return item, None
    import av

    if not os.path.isfile(item.source):
        item.error = "missing file"
        return item, None
    try:
        t0 = _seconds(item.extra.get("start", 0), "start")
        t1 = _seconds(item.extra["end"], "end") if "end" in item.extra else float("inf")
    except ValueError as e:
        item.error = f"malformed manifest row: {e}"
        return item, None
    step = 1.0 / opts.fps
    stride = max(1, round(opts.stride * opts.fps)) if opts.stride > 0 else opts.frames
    clip_len = opts.frames * step
    samples: list[dict] = []
    buf: deque = deque(maxlen=opts.frames)
    n_out = 0  # resampled frames so far
    last_t = None
    try:
        with av.open(item.source) as c:
            st = c.streams.video[0]
            st.thread_type = "AUTO"
            base = float(st.start_time * st.time_base) if st.start_time is not None else 0.0
            rate = float(st.average_rate) if st.average_rate else opts.fps
            prev = None  # (time, frame, cached array)

            def emit(entry):
                nonlocal n_out
                if entry[2] is None:
                    entry[2] = _resize(entry[1].to_image(), opts)
                buf.append(entry[2])
                n_out += 1
                if n_out >= opts.frames and (n_out - opts.frames) % stride == 0:
                    k = len(samples)
                    data, codec = encode_mp4(list(buf), opts.fps, opts.crf)
                    h, w = buf[0].shape[:2]
                    start = t0 + (n_out - opts.frames) * step
                    meta = {"frames": opts.frames, "fps": opts.fps, "height": h, "width": w,
                            "duration": round(clip_len, 6), "source": item.source,
                            "start": round(start, 6), "clip": k, "codec": codec}  # fmt: skip
                    samples.append({"__key__": f"{item.index:09d}-{k:04d}", "mp4": data,
                                    "txt": item.caption, "json": json.dumps(meta, sort_keys=True)})  # fmt: skip

            def full():
                return opts.clips_per_video and len(samples) >= opts.clips_per_video

            for frame in c.decode(st):
                if frame.pts is None:
                    continue
                t = float(frame.pts * st.time_base) - base
                last_t = t
                while prev is not None and t0 + n_out * step < min(t, t1) and not full():
                    emit(prev)  # the latest frame at or before each output time
                if full() or t >= t1:
                    break
                prev = [t, frame, None]
            if prev is not None:  # the last frame lasts one source frame period
                while t0 + n_out * step < min(prev[0] + 1.0 / rate, t1) and not full():
                    emit(prev)
    except Exception as e:  # av raises many types for broken files; all mean "unreadable"
        item.error = f"unreadable video: {type(e).__name__}: {e}"
        return item, None
    if not samples:
        have = max(0.0, (last_t if last_t is not None else 0.0) - t0)
        item.error = f"too short: {have:.2f}s from start {t0:g}s < clip length {clip_len:.2f}s"
        return item, None
    return item, samples


class VideoWork:
    def __init__(self, opts: VideoOpts):
        self.opts = opts

    def __call__(self, item: Item):
        return process_video(item, self.opts)
