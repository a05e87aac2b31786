"""decode_video / VideoDecoder: shape, frame count, pixel fidelity (H.264 is lossy), bad bytes."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

av = pytest.importorskip("av")

from common.data.media import VideoDecodeError, VideoDecoder, decode_video  # noqa: E402

T, H, W = 8, 48, 64
# Smooth gradients plus a per-frame brightness step, encoded at CRF 18: mean abs error is ~2 of
# 255 in practice (yuv420p chroma subsampling and quantisation); the bound leaves ample margin.
MAX_MEAN_ABS_ERR = 6.0


def _frames() -> np.ndarray:
    y, x = np.mgrid[0:H, 0:W]
    out = np.zeros((T, H, W, 3), np.uint8)
    for t in range(T):
        out[t, ..., 0] = (x * 255 // (W - 1)).astype(np.uint8)
        out[t, ..., 1] = 20 + 25 * t
        out[t, ..., 2] = (y * 255 // (H - 1)).astype(np.uint8)
    return out


def _encode(frames: np.ndarray, fps: int = 8) -> bytes:
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        st = c.add_stream(codec, rate=fps)
        st.height, st.width = frames.shape[1:3]
        st.pix_fmt = "yuv420p"
        st.options = {"crf": "18", "bf": "0"} if codec == "libx264" else {"qscale": "2"}
        for a in frames:
            for pkt in st.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                c.mux(pkt)
        for pkt in st.encode():
            c.mux(pkt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def clip():
    frames = _frames()
    return frames, _encode(frames)


def test_decode_shape_count_and_pixels(clip):
    frames, data = clip
    v = decode_video(data, dtype=torch.uint8)
    assert v.shape == (T, 3, H, W) and v.dtype == torch.uint8
    err = (v.permute(0, 2, 3, 1).float() - torch.from_numpy(frames).float()).abs().mean().item()
    assert err < MAX_MEAN_ABS_ERR, err
    # Frame order survives: the green channel steps up by 25 per frame.
    g = v[:, 1].float().mean(dim=(1, 2))
    assert torch.all(g[1:] > g[:-1])


def test_float_range_num_frames_and_resize(clip):
    frames, data = clip
    v = decode_video(data, num_frames=5)
    assert v.shape == (5, 3, H, W) and v.dtype == torch.float32
    assert v.min() >= -1.0 and v.max() <= 1.0
    ref = torch.from_numpy(frames[:5]).permute(0, 3, 1, 2).float() / 127.5 - 1
    assert (v - ref).abs().mean().item() < MAX_MEAN_ABS_ERR / 127.5
    sq = decode_video(data, num_frames=3, size=32)  # cover 32x32 (48x64 -> 32x43), centre-crop
    assert sq.shape == (3, 3, 32, 32)
    rect = decode_video(data, size=(24, 40))
    assert rect.shape == (T, 3, 24, 40)


def test_too_few_frames_and_corrupt_bytes(clip):
    _, data = clip
    with pytest.raises(VideoDecodeError, match="8 frames, 9 requested"):
        decode_video(data, num_frames=9)
    for bad in (b"", b"not a video at all" * 50, data[: len(data) // 2]):
        with pytest.raises(VideoDecodeError):
            decode_video(bad)
    assert issubclass(VideoDecodeError, ValueError)


def test_video_decoder_and_loader_counts_corrupt(clip, tmp_path):
    import webdataset as wds

    from common.data import StreamingLoader

    _, data = clip
    dec = VideoDecoder(num_frames=4, size=32)
    out = dec({"mp4": data, "txt": b" a clip \n"})
    assert out["caption"] == "a clip" and out["video"].shape == (4, 3, 32, 32)
    out = dec({"mp4": data, "txt": b"x", "__bucket__": (2, 16, 24)})
    assert out["video"].shape == (2, 3, 16, 24)
    with pytest.raises(ValueError, match="no mp4"):
        dec({"txt": b"x"})

    d = tmp_path / "shards"
    d.mkdir()
    with wds.TarWriter(str(d / "shard-000000.tar")) as w:
        for i in range(4):
            w.write({"__key__": f"{i:04d}", "mp4": data if i != 2 else b"\x00garbage" * 64,
                     "txt": f"clip {i}"})
    ld = StreamingLoader(str(d), dec, 4, num_workers=0, shuffle=False)
    batch = next(iter(ld))
    assert batch["video"].shape == (4, 4, 3, 32, 32)
    assert batch["__corrupt__"] == 1
    assert "0002" not in batch["__key__"]
