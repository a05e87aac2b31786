"""The synthetic VQA mode of data.synth: conversation layout, answers vs pixels, held-out
compositions, determinism, CLI."""

import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from common.data.captions import caption_of
from common.data.shards import ShardIndex, expand_shards
from data import shapes as S
from data import synth, synth_vqa as V
from data.shape_analysis import analyse
from tests.conftest import file_tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = dict(count=60, heldout_count=30, size=48, shard_size=25, seed=0)


def _read(d, split):
    index = ShardIndex(expand_shards(os.path.join(d, split)))
    return [index.read(k, i) for k, n in enumerate(index.shard_sizes) for i in range(n)]


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("vqa"))
    summary = V.generate_vqa(out, **ARGS)
    return out, summary, {sp: _read(out, sp) for sp in ("train", "heldout")}


def test_counts_shards_manifest(ds):
    out, summary, samples = ds
    assert summary["counts"] == {"train": 60, "heldout": 30}
    assert summary["shards"]["train"] == [f"train/shard-{k:06d}.tar" for k in range(3)]
    assert summary["shards"]["heldout"] == [f"heldout/shard-{k:06d}.tar" for k in range(2)]
    assert len(samples["train"]) == 60 and len(samples["heldout"]) == 30
    keys = [s["__key__"] for sp in samples.values() for s in sp]
    assert len(set(keys)) == len(keys) and keys[0] == "train-00000000"
    man = synth.load_manifest(out)
    assert man["mode"] == "vqa" and man["args"] == ARGS and man["image_marker"] == "<image>"
    assert [tuple(c) for c in man["heldout_compositions"]] == V.HELDOUT_COMPOSITIONS


def test_conversation_layout(ds):
    _, _, samples = ds
    for s in samples["train"] + samples["heldout"]:
        assert set(s) == {"__key__", "__url__", "png", "txt", "json"}  # one image, as `conversations` writes
        m = json.loads(s["json"])
        turns, qa = m["turns"], m["qa"]
        assert m["images"] == 1 and m["sizes"] == [[48, 48]] and m["source"] == "synth"
        assert [t["role"] for t in turns] == ["user", "assistant"] * (len(turns) // 2) and len(turns) % 2 == 0
        assert turns[0]["content"].startswith("<image>\n")
        assert sum(t["content"].count("<image>") for t in turns) == 1
        assert 2 <= len(qa) <= 4 and len({q["type"] for q in qa}) == len(qa)
        asked = []
        for q, (u, a) in zip(qa, zip(turns[::2], turns[1::2])):
            assert u["content"].removeprefix("<image>\n") == q["question"] and a["content"] == q["answer"]
            vocab = {"colour": S.COLOURS, "shape": S.SHAPES, "count": ("1", "2", "3"), "position": S.POSITIONS}
            assert q["answer"] in vocab[q["type"]], q
            # No earlier question states this answer: it must come from the image.
            assert not any(re.search(rf"\b{q['answer']}\b", x) for x in asked), (asked, q)
            asked.append(q["question"])
        assert caption_of(s) == m["caption"]
        img = np.asarray(Image.open(io.BytesIO(s["png"])))
        assert img.shape == (48, 48, 3) and img.dtype == np.uint8
        np.testing.assert_array_equal(img, V.render_vqa(m))  # png is the lossless render


def _cells(img):
    """What each 3x3 grid cell shows, read from pixels alone: (colour, shape) or None."""
    n = img.shape[0] // 3
    out = []
    for k in range(9):
        r, c = divmod(k, 3)
        res = analyse(img[r * n:(r + 1) * n, c * n:(c + 1) * n])
        out.append(None if res["colour"] is None else (res["colour"], res["shape"]))
    return out


def _cell_named(question):
    hits = [k for k, (_, _, phrase) in enumerate(S.POSITIONS.values()) if question.endswith(phrase + "?")]
    assert len(hits) == 1, question
    return hits[0]


def _kind_named(question):
    colour = [c for c in S.COLOURS if re.search(rf"\b{c}\b", question)]
    shape = [s for s in S.SHAPES if re.search(rf"\b({s}|{V.plural(s)})\b", question)]
    assert len(colour) == 1 and len(shape) == 1, question
    return colour[0], shape[0]


def test_answers_match_pixels(ds):
    # Every answer re-derived from the decoded png and the question text only.
    _, _, samples = ds
    n_checked = {t: 0 for t in V.QUESTION_TYPES}
    for s in samples["train"] + samples["heldout"]:
        m = json.loads(s["json"])
        cells = _cells(np.asarray(Image.open(io.BytesIO(s["png"]))))
        assert [c for c in cells if c] == [(o["colour"], o["shape"]) for o in m["objects"]]
        for q in m["qa"]:
            if q["type"] in ("colour", "shape"):
                seen = cells[_cell_named(q["question"])]
                assert seen is not None and seen[0 if q["type"] == "colour" else 1] == q["answer"], q
            elif q["type"] == "count":
                assert sum(c == _kind_named(q["question"]) for c in cells) == int(q["answer"]), q
            else:
                where = [k for k, c in enumerate(cells) if c == _kind_named(q["question"])]
                assert len(where) == 1 and V.CELLS[where[0]] == q["answer"], q
            n_checked[q["type"]] += 1
    assert min(n_checked.values()) >= 10, n_checked
    print(f"\nanswers re-derived from pixels: {n_checked}")


def test_heldout_compositions_never_in_train():
    held = set(V.HELDOUT_COMPOSITIONS)
    every = {(c, s, n) for c in S.COLOURS for s in S.SHAPES for n in V.COUNTS}
    assert held <= every and held.isdisjoint(V.TRAIN_COMPOSITIONS) and held | set(V.TRAIN_COMPOSITIONS) == every
    train = [V.vqa_attrs("train", i, 7) for i in range(3000)]
    heldout = [V.vqa_attrs("heldout", i, 7) for i in range(600)]
    for a in train:
        assert not held & {tuple(c) for c in a["compositions"]} and not a["heldout"]
        # The image/video modes' held-out pairs stay out of VQA train at any count.
        assert not {(o["shape"], o["colour"]) for o in a["objects"]} & set(S.HELDOUT_COMBOS)
    for a in heldout:
        assert [tuple(c) for c in a["compositions"] if tuple(c) in held] == [tuple(a["target"])] and a["heldout"]
    assert {tuple(a["target"]) for a in heldout} == held  # every held-out composition is tested
    # Compositional: each part of a held-out composition was seen in training, with other partners.
    seen = {tuple(c) for a in train for c in a["compositions"]}
    assert seen == set(V.TRAIN_COMPOSITIONS)
    for c, s, n in V.HELDOUT_COUNTS:
        assert any((c, s) == x[:2] for x in seen) and any((c, n) == (x[0], x[2]) for x in seen)
        assert any((s, n) == x[1:] for x in seen)


def test_heldout_split_in_shards(ds):
    _, _, samples = ds
    held = set(V.HELDOUT_COMPOSITIONS)
    for s in samples["train"]:
        assert not held & {tuple(c) for c in json.loads(s["json"])["compositions"]}
    for s in samples["heldout"]:
        m = json.loads(s["json"])
        assert [tuple(c) for c in m["compositions"] if tuple(c) in held] == [tuple(m["target"])]
        count_q = [q for q in m["qa"] if q["type"] == "count"]
        assert all(q["answer"] == str(m["target"][2]) for q in count_q)


def test_same_seed_same_bytes(ds, tmp_path):
    out, _, samples = ds
    again = str(tmp_path / "again")
    V.generate_vqa(again, **ARGS)
    assert file_tree(out) == file_tree(again)
    other = _read(V.generate_vqa(str(tmp_path / "other"), **{**ARGS, "seed": 1})["out"], "train")
    assert sum(a["png"] != b["png"] for a, b in zip(samples["train"], other)) > 50
    # Per-sample seeding: a sample does not depend on the count.
    one = V.make_vqa_sample("train", 7, 0, 48)
    assert (one["png"], one["json"]) == (samples["train"][7]["png"], samples["train"][7]["json"])


def test_cli(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}

    def run(*args):
        return subprocess.run([sys.executable, "-m", "data.synth", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    h = run("--vqa", "--help")
    assert h.returncode == 0 and "--vqa" in h.stdout and "question" in h.stdout
    for bad in (["--count", "-1"], ["--size", "16"], ["--video"]):
        r = run("--vqa", "--out", str(tmp_path / "bad"), *bad)
        assert r.returncode == 2 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    out = str(tmp_path / "cli")
    assert synth.main(["--vqa", "--out", out, "--count", "5", "--heldout-count", "3", "--no-progress"]) == 0
    assert synth.load_manifest(out)["args"] == {"count": 5, "heldout_count": 3, "size": 48, "shard_size": 1000,
                                                "seed": 0}  # fmt: skip
    assert len(_read(out, "train")) == 5 and len(_read(out, "heldout")) == 3
    assert V.ensure_vqa(out, count=5, heldout_count=3)["seconds"] == 0.0  # reused, not regenerated
