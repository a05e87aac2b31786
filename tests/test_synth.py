"""The synthetic shapes dataset: determinism, counts, captions, held-out split, plain readability."""

import glob
import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from data import shapes as S
from data import synth

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = dict(count=60, heldout_count=24, size=32, shard_size=25, seed=0)


def _files(d):
    return sorted(os.path.relpath(p, d) for p in glob.glob(os.path.join(d, "**", "*"), recursive=True)
                  if os.path.isfile(p))  # fmt: skip


def _words(text):
    return re.findall(r"[a-z]+", text)


def _read(d, split):
    urls = sorted(glob.glob(os.path.join(d, split, "*.tar")))
    return list(wds.WebDataset(urls, shardshuffle=False))


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("synth"))
    return out, synth.generate(out, **ARGS)


def test_counts_shards_and_manifest(ds):
    out, summary = ds
    assert summary["counts"] == {"train": 60, "heldout": 24}
    assert summary["shards"]["train"] == [f"train/shard-{k:06d}.tar" for k in range(3)]
    assert summary["shards"]["heldout"] == ["heldout/shard-000000.tar"]
    train, held = _read(out, "train"), _read(out, "heldout")
    assert len(train) == 60 and len(held) == 24
    keys = [s["__key__"] for s in train + held]
    assert len(set(keys)) == len(keys) and keys[0] == "train-00000000"
    man = synth.load_manifest(out)
    assert man["args"] == ARGS and man["counts"] == summary["counts"]
    assert [tuple(c) for c in man["heldout_combos"]] == S.HELDOUT_COMBOS


def test_sample_content_png_is_lossless_render(ds):
    out, _ = ds
    for s in _read(out, "train")[:10] + _read(out, "heldout")[:5]:
        attrs = json.loads(s["json"])
        img = np.asarray(Image.open(io.BytesIO(s["png"])))
        assert img.shape == (32, 32, 3) and img.dtype == np.uint8
        np.testing.assert_array_equal(img, synth.render_sample(attrs))
        assert s["txt"].decode() == attrs["caption"]
        assert attrs["split"] + "-" in s["__key__"]
        # The border is pure background: the analyser depends on it.
        assert (img[0] == attrs["background_rgb"]).all() and (img[:, -1] == attrs["background_rgb"]).all()


def test_same_seed_same_bytes_other_seed_differs(ds, tmp_path):
    out, _ = ds
    again = str(tmp_path / "again")
    synth.generate(again, **ARGS)
    assert _files(out) == _files(again)
    for f in _files(out):
        with open(os.path.join(out, f), "rb") as a, open(os.path.join(again, f), "rb") as b:
            assert a.read() == b.read(), f
    other = str(tmp_path / "other")
    synth.generate(other, **{**ARGS, "seed": 1})
    a, b = _read(out, "train"), _read(other, "train")
    assert sum(x["png"] != y["png"] for x, y in zip(a, b)) > 50
    assert [x["json"] for x in a] != [y["json"] for y in b]


def test_samples_do_not_depend_on_count():
    # Per-sample seeding: a bigger dataset extends a smaller one instead of reshuffling it.
    assert synth.make_sample("train", 7, 3, 32) == synth.make_sample("train", 7, 3, 32)
    assert synth.sample_attrs("train", 7, 3, 32) != synth.sample_attrs("heldout", 7, 3, 32)


def test_captions_name_colour_and_shape(ds):
    out, _ = ds
    for split in ("train", "heldout"):
        for s in _read(out, split):
            attrs, text = json.loads(s["json"]), s["txt"].decode()
            assert attrs["colour"] in _words(text) and attrs["shape"] in _words(text), text
    # Every template, filled for every colour, keeps both words (and its article right).
    for t in range(len(synth.TEMPLATES)):
        for c in S.COLOURS:
            a = {**synth.sample_attrs("train", 0, 0, 32), "colour": c}
            text = synth.caption(a, t)
            assert c in _words(text) and a["shape"] in _words(text)
            assert " a orange" not in text and "an red" not in text
    texts = {synth.sample_attrs("train", i, 0, 32)["caption"] for i in range(200)}
    used = {synth.sample_attrs("train", i, 0, 32)["template"] for i in range(200)}
    assert len(texts) > 100 and used == set(range(len(synth.TEMPLATES)))


def test_heldout_combos_never_in_train_and_vocab_still_covered(ds):
    held = set(S.HELDOUT_COMBOS)
    assert len(held) == len(S.HELDOUT_COMBOS)
    assert all(s in S.SHAPES and c in S.COLOURS for s, c in held)
    train_pairs = {(a["shape"], a["colour"]) for a in (synth.sample_attrs("train", i, 5, 32) for i in range(3000))}
    held_pairs = {(a["shape"], a["colour"]) for a in (synth.sample_attrs("heldout", i, 5, 32) for i in range(300))}
    assert not train_pairs & held
    assert held_pairs == held  # held-out uses only, and all of, the held-out pairs
    assert train_pairs == set(S.train_combos())
    # Compositional generalisation is only testable if each part was seen in training.
    assert {s for s, _ in train_pairs} == set(S.SHAPES)
    assert {c for _, c in train_pairs} == set(S.COLOURS)
    out, _ = ds
    for s in _read(out, "train"):
        a = json.loads(s["json"])
        assert (a["shape"], a["colour"]) not in held
    for s in _read(out, "heldout"):
        a = json.loads(s["json"])
        assert (a["shape"], a["colour"]) in held


def test_attributes_are_valid(ds):
    out, _ = ds
    for s in _read(out, "train"):
        a = json.loads(s["json"])
        assert a["background"] in S.BACKGROUNDS and a["size"] in S.SIZES and a["position"] in S.POSITIONS
        assert abs(a["radius"] / S.SIZES[a["size"]] - 1) <= 0.081
        assert a["radius"] < a["cx"] < 1 - a["radius"] and a["radius"] < a["cy"] < 1 - a["radius"]


def test_regenerate_smaller_removes_stale_shards_and_ensure_reuses(tmp_path):
    out = str(tmp_path / "d")
    synth.generate(out, count=30, heldout_count=5, shard_size=10)
    synth.generate(out, count=12, heldout_count=0, shard_size=10)
    assert len(glob.glob(os.path.join(out, "train", "*.tar"))) == 2
    assert glob.glob(os.path.join(out, "heldout", "*.tar")) == []
    assert len(_read(out, "train")) == 12
    r = synth.ensure(out, count=12, heldout_count=0, shard_size=10)
    assert r["seconds"] == 0.0  # reused, not regenerated
    r = synth.ensure(out, count=13, heldout_count=0, shard_size=10)
    assert r["counts"]["train"] == 13 and len(_read(out, "train")) == 13
    with pytest.raises(ValueError):
        synth.generate(out, count=-1)


def test_cli(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    h = subprocess.run([sys.executable, "-m", "data.synth", "--help"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert h.returncode == 0
    for flag in ("--out", "--count", "--heldout-count", "--size", "--shard-size", "--seed"):
        assert flag in h.stdout
    r = subprocess.run([sys.executable, "-m", "data.synth", "--out", str(tmp_path), "--count", "5",
                        "--heldout-count", "3", "--size", "16", "--no-progress"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert "train = 5" in last and "heldout = 3" in last and "2 shards" in last
