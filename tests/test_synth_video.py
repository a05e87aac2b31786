"""Synthetic video mode of data.synth and the motion analyser: determinism, splits, format, accuracy."""

import glob
import io
import json
import os

import numpy as np
import pytest
import webdataset as wds

from data import shapes as S
from data import synth, synth_video
from data.motion_analysis import analyse, score
from tests.conftest import file_tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _decode_mp4(data: bytes) -> np.ndarray:
    import av

    with av.open(io.BytesIO(data)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


def _read(d, split="*"):
    return list(wds.WebDataset(sorted(glob.glob(os.path.join(d, split, "*.tar"))), shardshuffle=False))


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """200 clips (160 train + 40 held-out), 8/12/16 frames, stored as both mp4 and npy."""
    out = str(tmp_path_factory.mktemp("vid"))
    summary = synth_video.generate_video(out, count=160, heldout_count=40, size=32, frames=[8, 12, 16],
                                   shard_size=64, seed=5, fmt="both")  # fmt: skip
    samples = _read(out)
    return out, summary, samples


def test_counts_splits_and_format(clips):
    out, summary, samples = clips
    assert summary["counts"] == {"train": 160, "heldout": 40}
    assert summary["shards"]["train"] == [f"train/shard-{k:06d}.tar" for k in range(3)]
    assert json.load(open(os.path.join(out, "manifest.json")))["mode"] == "video"
    held = {tuple(c) for c in S.HELDOUT_COMBOS}
    assert len(samples) == 200
    for s in samples:
        a = json.loads(s["json"])
        assert set(s) >= {"__key__", "mp4", "npy", "txt", "json"}
        assert s["__key__"] == f"{a['split']}-{a['index']:08d}"
        assert ((a["shape"], a["colour"]) in held) == (a["split"] == "heldout")
        cap = s["txt"].decode()
        assert cap == a["caption"] and a["shape"] in cap and a["colour"] in cap
        assert synth_video.MOTIONS[a["motion"]][a["phrase"]] in cap
        raw = np.load(io.BytesIO(s["npy"]))
        assert raw.dtype == np.uint8 and raw.shape == (a["frames"], a["height"], a["width"], 3)
        assert np.array_equal(raw, synth_video.render_video(a))  # json alone reproduces the frames
        assert a["duration"] == a["frames"] / a["fps"] and a["codec"] in ("libx264", "mpeg4")
        m = _decode_mp4(s["mp4"])
        assert m.shape == raw.shape
        assert np.abs(m.astype(int) - raw).mean() < 12  # lossy, but the same picture
        # Motion is what the attributes say.
        mv = a["motion"]
        dx, dy = a["cx_end"] - a["cx_start"], a["cy_end"] - a["cy_start"]
        dr = a["radius_end"] - a["radius_start"]
        assert {"left_to_right": dx > 0.15, "right_to_left": dx < -0.15, "down": dy > 0.15, "up": dy < -0.15,
                "growing": dr > 0.08, "shrinking": dr < -0.08,
                "static": dx == dy == dr == 0}[mv]  # fmt: skip
    assert {json.loads(s["json"])["frames"] for s in samples} == {8, 12, 16}
    assert {json.loads(s["json"])["motion"] for s in samples} == set(synth_video.MOTIONS)


def test_shape_stays_inside_with_margin():
    for i in range(300):
        a = synth_video.video_attrs("train", i, 3, sizes=(32, 48), frames=(8, 16))
        for cx, cy, r in synth_video.frame_params(a):
            m = 1.5 / a["height"] - 1e-6
            assert r + m <= cx <= 1 - r - m and r + m <= cy <= 1 - r - m


def test_deterministic_bytes_and_variable_sizes(tmp_path):
    kw = dict(count=14, heldout_count=4, size=[32, 48], frames=[8, 12], shard_size=6, seed=1)
    for fmt in ("mp4", "npy"):
        a, b = str(tmp_path / f"a{fmt}"), str(tmp_path / f"b{fmt}")
        synth_video.generate_video(a, fmt=fmt, **kw)
        synth_video.generate_video(b, fmt=fmt, **kw)
        ta, tb = file_tree(a), file_tree(b)
        assert ta == tb and len(ta) == 3 + 1 + 1  # train: 3 shards, heldout: 1, manifest
        samples = _read(a)
        assert {fmt, "txt", "json"} <= set(samples[0]) and ({"mp4", "npy"} - {fmt}).isdisjoint(samples[0])
        assert {json.loads(s["json"])["height"] for s in samples} == {32, 48}
    # Another seed gives other clips; a sample does not depend on the count.
    assert synth_video.video_attrs("train", 3, 1) != synth_video.video_attrs("train", 3, 2)
    small = _read(str(tmp_path / "anpy"), "train")
    synth_video.generate_video(str(tmp_path / "c"), fmt="npy", **{**kw, "count": 7})
    assert [s["npy"] for s in _read(str(tmp_path / "c"), "train")] == [s["npy"] for s in small[:7]]


def test_invalid_args(tmp_path):
    for bad in (dict(size=33), dict(size=8), dict(frames=1), dict(fmt="gif"), dict(motions=["spin"]),
                dict(count=-1)):  # fmt: skip
        with pytest.raises(ValueError):
            synth_video.generate_video(str(tmp_path), **{"count": 2, "heldout_count": 0, "size": 32, **bad})
    synth_video.generate_video(str(tmp_path / "odd"), count=1, heldout_count=0, size=33, fmt="npy")  # raw allows odd


def test_cli_and_ensure(tmp_path):
    out = str(tmp_path / "cli")
    assert synth.main(["--video", "--out", out, "--count", "5", "--heldout-count", "2", "--frames", "8,12",
                       "--sizes", "32", "--motions", "up,down", "--raw-frames", "--no-progress"]) == 0  # fmt: skip
    samples = _read(out)
    assert len(samples) == 7 and all("npy" in s and "mp4" not in s for s in samples)
    assert {json.loads(s["json"])["motion"] for s in samples} <= {"up", "down"}
    r = synth_video.ensure_video(out, count=5, heldout_count=2, frames=[8, 12], motions=["up", "down"], fmt="npy")
    assert r["seconds"] == 0.0  # reused
    r = synth_video.ensure_video(out, count=6, heldout_count=2, frames=[8, 12], motions=["up", "down"], fmt="npy")
    assert r["counts"]["train"] == 6 and r["seconds"] > 0


def test_analyser_accuracy_raw_and_mp4(clips):
    _, _, samples = clips
    attrs = [json.loads(s["json"]) for s in samples]
    raw = [np.load(io.BytesIO(s["npy"])) for s in samples]
    mp4 = [_decode_mp4(s["mp4"]) for s in samples]
    for name, frames in (("raw", raw), ("mp4", mp4)):
        r = score(frames, attrs)
        print(f"\nmotion analyser on {r['n']} {name} clips: colour {r['colour_acc']:.3f}, shape "
              f"{r['shape_acc']:.3f}, motion {r['motion_acc']:.3f}, all {r['all_acc']:.3f}")  # fmt: skip
        assert r["n"] == 200
        assert r["motion_acc"] >= 0.98 and r["colour_acc"] >= 0.97 and r["shape_acc"] >= 0.95
        assert min(r["motion_acc_by_motion"].values()) >= 0.9
    # score also takes (frames, attrs) records.
    assert score(list(zip(raw[:5], attrs[:5])))["n"] == 5


def test_analyser_inputs_and_failures():
    a = synth_video.video_attrs("train", 2, 0, frames=(8,))
    clip = synth_video.render_video(a)
    r = analyse(clip)
    assert r["confident"] and (r["motion"], r["shape"], r["colour"]) == (a["motion"], a["shape"], a["colour"])
    assert r["background"] == a["background"]
    # (T, 3, H, W) in [-1, 1], as a model or decode_video hands it over.
    chw = np.moveaxis(clip, -1, 1).astype(np.float32) / 127.5 - 1
    assert analyse(chw)["motion"] == a["motion"]
    # Reversed time reverses the motion.
    rev = {"left_to_right": "right_to_left", "right_to_left": "left_to_right", "up": "down", "down": "up",
           "growing": "shrinking", "shrinking": "growing", "static": "static"}  # fmt: skip
    assert analyse(clip[::-1])["motion"] == rev[a["motion"]]
    blank = np.zeros((8, 32, 32, 3), np.uint8)
    r = analyse(blank)
    assert r["motion"] is None and r["shape"] is None and not r["confident"]
    for bad in (None, np.zeros((3, 3)), np.zeros((0, 32, 32, 3)), "x"):
        assert not analyse(bad)["confident"]
    noise = np.random.default_rng(0).integers(0, 256, (8, 32, 32, 3), dtype=np.uint8)
    assert not analyse(noise)["confident"]
    assert score([], [])["n"] == 0


def test_reverse_motion_swaps_the_phrase_for_the_opposite_one():
    from data.synth_video import MOTIONS, OPPOSITE_MOTION, VIDEO_TEMPLATES, reverse_motion, video_caption
    sizes = {"growing": ("small", "large"), "shrinking": ("large", "small")}
    for motion in MOTIONS:
        start, end = sizes.get(motion, ("small", "small"))
        for phrase in range(len(MOTIONS[motion])):
            for template in range(len(VIDEO_TEMPLATES)):
                a = {"colour": "red", "shape": "circle", "background": "blue", "motion": motion, "phrase": phrase,
                     "size_start": start, "size_end": end}
                caption = video_caption(a, template, phrase)
                got = reverse_motion(caption, a)
                if motion == "static":
                    assert got is None
                    continue
                # The caption of the clip played backwards: opposite motion, sizes swapped.
                backwards = {**a, "motion": OPPOSITE_MOTION[motion], "size_start": end, "size_end": start}
                assert got == (video_caption(backwards, template, phrase), backwards["motion"])
                assert reverse_motion(got[0], backwards) == (caption, motion)
    assert reverse_motion("a red circle", {"motion": "up", "phrase": 0}) is None  # phrase missing
