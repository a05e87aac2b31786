"""data.stats: counts, histograms, duplicates and corrupt samples of shards made here."""

import io
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import webdataset as wds
from PIL import Image

from data import stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _png(w, h, seed):
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _make(d):
    """Shard 0: 64x32 'a b c' (json size), 32x32 'one two' + its duplicate, corrupt png.
    Shard 1: 48x16 with 10-word caption (size from the header), a video sample (json only),
    no caption sample. Plus a truncated shard 2."""
    dup = _png(32, 32, 1)
    with wds.TarWriter(os.path.join(d, "s-0.tar"), mtime=0.0) as w:
        w.write({"__key__": "a", "png": _png(64, 32, 0), "txt": "a b c", "json": json.dumps({"size": [64, 32]})})
        w.write({"__key__": "b", "png": dup, "txt": "one two", "json": b"{}"})
        w.write({"__key__": "c", "png": dup, "txt": "one two", "json": b"{}"})
        w.write({"__key__": "bad", "png": b"\x89PNG garbage", "txt": "broken", "json": b"{}"})
    with wds.TarWriter(os.path.join(d, "s-1.tar"), mtime=0.0) as w:
        w.write({"__key__": "d", "png": _png(48, 16, 2), "txt": " ".join(["w"] * 10)})
        w.write({"__key__": "v", "mp4": b"\x00" * 100, "txt": "a moving dot",
                 "json": json.dumps({"width": 16, "height": 16, "frames": 8, "duration": 2.0})})
        w.write({"__key__": "e", "png": _png(16, 16, 3)})
    raw = open(os.path.join(d, "s-0.tar"), "rb").read()
    with tarfile.open(os.path.join(d, "s-0.tar")) as t:
        cut = [m for m in t.getmembers() if m.name.startswith("b.")][-1].offset_data + 10
    open(os.path.join(d, "s-2.tar"), "wb").write(raw[:cut])  # cut inside sample "b"


def test_stats(tmp_path):
    src, out = tmp_path / "shards", tmp_path / "stats"
    src.mkdir()
    _make(str(src))
    assert stats.main([str(src), "--out", str(out), "--no-progress", "--workers", "2"]) == 0
    s = json.load(open(out / "stats.json"))
    assert s["shards"] == 3
    n2 = s["samples"] - 7  # s-2 is cut inside sample "b": only "a" is read
    assert n2 == 1
    assert len(s["corrupt"]["shards"]) == 1 and "s-2.tar" in s["corrupt"]["shards"][0]["shard"]
    assert s["corrupt"]["count"] == 1 and s["corrupt"]["examples"][0]["key"] == "bad"
    assert s["members"]["mp4"] == {"count": 1, "bytes": 100}
    assert s["members"]["png"]["count"] == 7
    assert s["bytes"] == sum(m["bytes"] for m in s["members"].values())
    good = 7  # everything but "bad"
    assert s["resolution"]["count"] == good
    for h in (s["resolution"]["short_side"], s["aspect_ratio"]):
        assert h["count"] == good and sum(h["counts"]) == good
    assert s["aspect_ratio"]["max"] == 3.0 and s["aspect_ratio"]["min"] == 1.0
    assert dict(map(tuple, s["resolution"]["top"]))["32x32"] == 2
    assert s["duration"]["count"] == 1 and s["duration"]["max"] == 2.0 and s["frames"]["counts"] == [1]
    # captions of the good samples, "e" has none; s-2's "a" adds one more 3-word caption
    assert s["caption"]["missing"] == 1
    words = s["caption"]["words"]
    assert words["count"] == 6 and sum(words["counts"]) == 6 and words["max"] == 10 and words["min"] == 2
    assert s["caption"]["chars"]["max"] == 19
    # b, c identical; s-2's "a" duplicates s-0's "a"
    d = s["duplicates"]
    assert d["groups"] == 2 and d["top"][0]["count"] == 2
    assert {"s-0.tar:b", "s-0.tar:c"} in [set(g["keys"]) for g in d["top"]]
    for f in ("report.md", "short_side.png", "aspect_ratio.png", "caption_words.png", "duration.png"):
        assert (out / f).stat().st_size > 0
    md = (out / "report.md").read_text()
    assert f"| samples | {s['samples']} |" in md and "| corrupt samples | 1 |" in md
    assert "| duplicate groups | 2 " in md and "![" in md and "(short_side.png)" in md and "| bad |" in md

    # --verify and single worker agree on the counts; CLI --help works
    assert stats.main([str(src / "s-0.tar"), str(src / "s-1.tar"), "--out", str(out / "v"), "--verify",
                       "--no-progress"]) == 0
    v = json.load(open(out / "v" / "stats.json"))
    assert v["samples"] == 7 and v["corrupt"]["count"] == 1 and v["duplicates"]["groups"] == 1
    r = subprocess.run([sys.executable, "-m", "data.stats", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "--workers" in r.stdout


def test_histogram_totals():
    h = stats.histogram([1, 2, 2, 3])
    assert h["counts"] == [1, 2, 1] and h["count"] == 4
    h = stats.histogram(np.linspace(0, 1, 101))
    assert sum(h["counts"]) == 101 and len(h["counts"]) == 20
    assert stats.histogram([]) == {"count": 0}
