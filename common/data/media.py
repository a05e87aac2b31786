"""Video encoding and decoding for shard samples (the `mp4` member of `make_shards videos` shards).

`encode_mp4(frames, fps, crf)` is the one encoder behind every mp4 we write (real video shards,
synthetic clips, training-time sample videos): one thread and fixed x264 settings, so the same
frames always give the same bytes.

`decode_video(mp4_bytes, num_frames, size)` decodes an in-memory clip with PyAV on one thread
(loader workers are the parallelism; ffmpeg's own threads would oversubscribe the cores) and
returns (T, C, H, W) frames, float in [-1, 1] or uint8. Scaling runs in swscale while the frame is
still in YUV (one pass, bilinear), then the centre crop is a view. Any failure raises
`VideoDecodeError` (a ValueError), which the StreamingLoader counts as a corrupt sample.
"""
from __future__ import annotations

import io
from fractions import Fraction

import numpy as np
import torch

__all__ = ["VideoDecodeError", "VideoDecoder", "decode_video", "encode_mp4", "mp4_codec"]


def mp4_codec() -> str:
    """The codec `encode_mp4` uses: libx264 (H.264) when this PyAV build has it, else MPEG-4 Part 2."""
    import av

    return "libx264" if "libx264" in av.codecs_available else "mpeg4"


def encode_mp4(frames: list[np.ndarray], fps: float, crf: int = 23) -> tuple[bytes, str]:
    """Encode uint8 (H, W, 3) RGB frames (even sides: yuv420p) at constant `fps`; -> (bytes, codec)."""
    import av

    codec = mp4_codec()
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        rate = Fraction(fps).limit_denominator(1001)
        st = c.add_stream(codec, rate=rate)
        st.height, st.width = frames[0].shape[:2]
        st.pix_fmt = "yuv420p"
        st.codec_context.thread_count = 1  # one thread: reproducible bytes
        if codec == "libx264":
            # x264's lookahead / mb-tree / scene-cut made the bytes differ between runs on tiny
            # frames; without them the same frames always encode to the same bytes.
            st.options = {"crf": str(crf), "preset": "veryfast", "bf": "0",
                          "x264-params": "rc-lookahead=0:mbtree=0:scenecut=0"}
        else:
            st.codec_context.qscale = 3
            st.options = {"qscale": "3"}
        for arr in frames:
            for pkt in st.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                c.mux(pkt)
        for pkt in st.encode():
            c.mux(pkt)
    return buf.getvalue(), codec


class VideoDecodeError(ValueError):
    """The bytes are not a decodable video (or hold fewer frames than asked for)."""


def _target(size, h: int, w: int) -> tuple[int, int, int, int] | None:
    """(scaled h, scaled w, out h, out w) for `size` = int (square) or (h, w); None: keep as is."""
    if size is None:
        return None
    th, tw = (int(size), int(size)) if isinstance(size, (int, np.integer)) else (int(size[0]), int(size[1]))
    if th < 1 or tw < 1:
        raise ValueError(f"video size must be positive, got {size!r}")
    if (th, tw) == (h, w):
        return None
    scale = max(th / h, tw / w)  # cover the target keeping the aspect, then centre-crop
    return max(th, round(h * scale)), max(tw, round(w * scale)), th, tw


def decode_video(mp4_bytes: bytes, num_frames: int | None = None, size=None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode a clip held in memory to a (T, 3, H, W) tensor.

    num_frames: take the first `num_frames` frames (None: all); a clip with fewer raises.
    size: int (square) or (height, width): scale to cover it keeping the aspect, then centre-crop;
        None keeps the stored size.
    dtype: torch.uint8 for raw RGB 0..255, a float dtype for values in [-1, 1].
    """
    if num_frames is not None and num_frames < 1:
        raise ValueError(f"num_frames must be >= 1, got {num_frames}")
    if not mp4_bytes:
        raise VideoDecodeError("empty video bytes")
    import av

    frames: list[np.ndarray] = []
    try:
        with av.open(io.BytesIO(mp4_bytes), mode="r") as container:
            if not container.streams.video:
                raise VideoDecodeError("no video stream in the container")
            st = container.streams.video[0]
            st.thread_type = "SLICE"
            st.codec_context.thread_count = 1
            geom = None
            for frame in container.decode(st):
                if geom is None:
                    geom = _target(size, frame.height, frame.width)
                if geom is None:
                    arr = frame.to_ndarray(format="rgb24")
                else:
                    sh, sw, th, tw = geom
                    arr = frame.to_ndarray(format="rgb24", width=sw, height=sh,
                                           interpolation="BILINEAR")
                    top, left = (sh - th) // 2, (sw - tw) // 2
                    arr = arr[top:top + th, left:left + tw]
                frames.append(arr)
                if num_frames is not None and len(frames) == num_frames:
                    break
    except VideoDecodeError:
        raise
    except Exception as e:  # av raises many types (InvalidDataError, EOFError, ...) for bad bytes
        raise VideoDecodeError(f"undecodable video ({len(mp4_bytes)} bytes): "
                               f"{type(e).__name__}: {e}") from e
    if not frames:
        raise VideoDecodeError(f"video holds no decodable frames ({len(mp4_bytes)} bytes)")
    if num_frames is not None and len(frames) < num_frames:
        raise VideoDecodeError(f"video has {len(frames)} frames, {num_frames} requested")
    video = torch.from_numpy(np.ascontiguousarray(np.stack(frames))).permute(0, 3, 1, 2)
    if dtype == torch.uint8:
        return video.contiguous()
    return video.to(dtype).div_(127.5).sub_(1.0)


class VideoDecoder:
    """Picklable sample decoder: {mp4, txt} -> {"video": (T, 3, H, W) float in [-1, 1], "caption"}.

    num_frames / size as in `decode_video` (size: int or (h, w); None keeps the stored shape).
    A `__bucket__` = (frames, h, w) in the sample (set by the loader when bucketing) overrides
    both. Any exception marks the sample corrupt in the loader.
    """

    def __init__(self, num_frames: int | None = 16, size=256, dtype: torch.dtype = torch.float32):
        self.num_frames, self.size, self.dtype = num_frames, size, dtype

    def __call__(self, sample: dict) -> dict:
        caption = sample.get("txt")
        if caption is None:
            raise ValueError("sample has no txt caption")
        raw = sample.get("mp4")
        if raw is None:
            raise ValueError("sample has no mp4 video")
        num_frames, size = self.num_frames, self.size
        bucket = sample.get("__bucket__")
        if bucket is not None:
            num_frames, size = int(bucket[0]), (int(bucket[1]), int(bucket[2]))
        text = caption.decode("utf-8").strip() if isinstance(caption, bytes) else str(caption)
        return {"video": decode_video(raw, num_frames, size, self.dtype), "caption": text}
