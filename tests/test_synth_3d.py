"""The synthetic 3-D mode of data.synth: sample layout, geometry vs the analytic sdf and the mesh,
held-out split, captions, determinism, CLI."""

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

from data import shapes3d as S3
from data import synth
from data import synth_3d as T
from data.sources.mesh import winding_number
from tests.conftest import file_tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = dict(count=40, heldout_count=14, points=1024, occupancy=1024, shard_size=16, seed=0)
_PALETTE = np.array(list(S3.COLOURS.values()), dtype=np.float64) / 255.0


def _read(d, split):
    return list(wds.WebDataset(sorted(glob.glob(os.path.join(d, split, "*.tar"))), shardshuffle=False))


def _arr(b):
    return np.load(io.BytesIO(b), allow_pickle=False)


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("synth3d"))
    summary = T.generate_3d(out, **ARGS)
    return out, summary, {sp: _read(out, sp) for sp in ("train", "heldout")}


def _one_per_shape(split="train"):
    """Attributes of the first sample of each shape (and of each aspect) among the first indices."""
    seen = {}
    for i in range(400):
        a = T.sample_attrs_3d(split, i, 0)
        seen.setdefault((a["shape"], a["aspect"]), a)
    assert len(seen) == sum(max(1, len(v)) for v in S3.ASPECTS3D.values())
    return list(seen.values())


def test_counts_shards_manifest(ds):
    out, summary, samples = ds
    assert summary["counts"] == {"train": 40, "heldout": 14}
    assert summary["shards"]["train"] == [f"train/shard-{k:06d}.tar" for k in range(3)]
    assert summary["shards"]["heldout"] == ["heldout/shard-000000.tar"]
    assert len(samples["train"]) == 40 and len(samples["heldout"]) == 14
    keys = [s["__key__"] for sp in samples.values() for s in sp]
    assert len(set(keys)) == len(keys) and keys[0] == "train-00000000"
    man = synth.load_manifest(out)
    assert man["mode"] == "3d" and man["args"] == ARGS
    assert [tuple(c) for c in man["heldout_combos"]] == S3.HELDOUT_COMBOS3D
    assert man["vocabulary"]["shapes"] == S3.SHAPES3D


def test_fields_dtypes_and_geometry(ds):
    _, _, samples = ds
    for s in samples["train"] + samples["heldout"]:
        assert {"npy", "occ.npy", "txt", "json"} <= set(s)
        meta = json.loads(s["json"])
        assert {"shape", "colour", "size", "aspect", "position", "params", "points", "occupancy"} <= set(meta)
        assert (meta["points"], meta["occupancy"]) == (1024, 1024)
        assert (meta["aspect"] is None) == (not S3.ASPECTS3D[meta["shape"]])
        assert meta["params"] == S3.primitive(meta)
        pts, occ = _arr(s["npy"]), _arr(s["occ.npy"])
        assert pts.shape == (1024, 6) and pts.dtype == np.float16
        assert occ.shape == (1024, 7) and occ.dtype == np.float16
        xyz, rgb = pts[:, :3].astype(np.float64), pts[:, 3:].astype(np.float64)
        assert np.abs(xyz).max() <= 0.5 and rgb.min() >= 0 and rgb.max() <= 1
        # On the analytic surface (tessellation + float16 keep it within ~1e-3) ...
        assert np.abs(S3.sdf(meta["shape"], meta["params"], xyz)).max() < 2e-3
        # ... and every point nearest its own named colour.
        nearest = np.argmin(((rgb[:, None] - _PALETTE[None]) ** 2).sum(-1), axis=1)
        assert (np.array(list(S3.COLOURS))[nearest] == meta["colour"]).all()
        q, lab = occ[:, :3].astype(np.float64), occ[:, 3]
        assert set(np.unique(lab)) <= {0.0, 1.0}
        # Labels are the analytic sdf at the stored coordinates: exact.
        assert ((S3.sdf(meta["shape"], meta["params"], q) < 0) == (lab == 1)).all()
        near, far = q[:512], q[512:]
        assert np.abs(far).max() <= 0.55 + 1e-3
        assert np.median(np.abs(S3.sdf(meta["shape"], meta["params"], near))) < 0.03
        assert 0.2 < lab[:512].astype(float).mean() < 0.8  # near the surface: both sides
        assert np.allclose(occ[:, 4:], pts[0, 3:])  # one colour per primitive


def test_occupancy_agrees_with_mesh_winding_number():
    agree = []
    for attrs in _one_per_shape():
        _, occ = T.sample_arrays_3d(attrs, points=512, occupancy=1024)
        mesh = S3.build_mesh(attrs)
        assert mesh.is_watertight
        w = winding_number(mesh.triangles, occ[:, :3].astype(np.float64))
        agree.append(((w > 0.5) == (occ[:, 3] == 1)).mean())
    assert min(agree) >= 0.99, agree


def test_sdf_is_the_distance_to_the_surface():
    # |sdf| against the nearest of a dense sample of the mesh surface: never more than the
    # tessellation below it, never more than the sample spacing above it (a bound, like a
    # max-of-planes pyramid, would be far off near edges).
    import trimesh
    from scipy.spatial import cKDTree

    rng = np.random.default_rng(0)
    for attrs in _one_per_shape():
        mesh = S3.build_mesh(attrs)
        dense, _ = trimesh.sample.sample_surface(mesh, 40000, seed=1)
        q = np.concatenate([rng.uniform(-0.55, 0.55, (1500, 3)), dense[:1500] + rng.normal(0, 0.03, (1500, 3))])
        d = np.abs(S3.sdf(attrs["shape"], attrs["params"], q))
        nearest = cKDTree(dense).query(q)[0]
        assert (nearest >= d - 1e-3).all() and (nearest <= d + 0.008).all(), attrs["shape"]


def test_every_primitive_inside_the_box():
    for i in range(1500):
        a = T.sample_attrs_3d("train" if i % 3 else "heldout", i, 0)
        c, e = np.array(a["params"]["center"]), np.array(a["params"]["extent"])
        assert (np.abs(c) + e / 2 <= 0.5).all(), a
        assert c[1] == c[2] == 0.0
        x0 = S3.POSITIONS3D[a["position"]][0]
        assert abs(c[0] - x0) <= S3.POSITION_JITTER + 0.03  # a large shape at the side moves in a bit
        assert abs(max(e) / S3.SIZES3D[a["size"]] - 1) <= S3.SIZE_JITTER + 1e-6


def test_heldout_combos_never_in_train(ds):
    held = S3.HELDOUT_COMBOS3D
    assert len(held) == 7 and sorted(s for s, _ in held) == sorted(S3.SHAPES3D)
    assert len({c for _, c in held}) == 7 and all(c in S3.COLOURS for _, c in held)
    assert not set(held) & set(S3.train_combos3d())
    assert len(S3.train_combos3d()) + len(held) == len(S3.SHAPES3D) * len(S3.COLOURS)
    train = {(a["shape"], a["colour"]) for a in (T.sample_attrs_3d("train", i, s) for s in (0, 1) for i in range(1500))}
    assert not train & set(held) and train == set(S3.train_combos3d())
    _, _, samples = ds
    for split, want in (("train", False), ("heldout", True)):
        for s in samples[split]:
            m = json.loads(s["json"])
            assert ((m["shape"], m["colour"]) in held) == want


def test_captions_name_the_attributes(ds):
    _, _, samples = ds
    captions = [(s["txt"].decode(), json.loads(s["json"])) for sp in samples.values() for s in sp]
    captions += [(a["caption"], a) for a in (T.sample_attrs_3d("train", i, 3) for i in range(300))]
    used = set()
    for text, m in captions:
        words = re.findall(r"[a-z]+", text)
        assert m["colour"] in words and m["shape"] in words, text
        assert "  " not in text and " ," not in text and ",," not in text and not re.search(r"\ba [aeiou]", text), text
        used.add(m["template"])
        if m["template"] >= 2:  # all but the two short templates: every attribute
            assert m["size"] in words and S3.POSITIONS3D[m["position"]][1] in text, text
            assert m["aspect"] is None or m["aspect"] in words, text
    assert used == set(range(len(T.TEMPLATES3D)))


def test_same_seed_same_bytes(ds, tmp_path):
    out, _, samples = ds
    again = str(tmp_path / "again")
    T.generate_3d(again, **ARGS)
    assert file_tree(out) == file_tree(again)
    other = _read(T.generate_3d(str(tmp_path / "other"), **{**ARGS, "seed": 1})["out"], "train")
    assert sum(a["npy"] != b["npy"] for a, b in zip(samples["train"], other)) > 30
    # Per-sample seeding: a sample depends on nothing but (seed, split, index).
    one = T.make_sample_3d("train", 7, 0, points=1024, occupancy=1024)
    s7 = samples["train"][7]
    assert (one["npy"], one["occ.npy"], one["json"]) == (s7["npy"], s7["occ.npy"], s7["json"])
    # The cloud does not depend on the occupancy count, nor the attributes on either.
    no_occ = T.make_sample_3d("train", 7, 0, points=1024, occupancy=0)
    assert "occ.npy" not in no_occ and no_occ["npy"] == s7["npy"]


def test_cli(tmp_path, capsys):
    env = {**os.environ, "PYTHONPATH": ROOT}
    h = subprocess.run([sys.executable, "-m", "data.synth", "--help"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert h.returncode == 0 and all(f in h.stdout for f in ("--3d", "--points", "--occupancy"))
    for bad in (["--size", "32"], ["--vqa"], ["--points", "0"], ["--occupancy", "-1"]):
        assert synth.main(["--3d", "--out", str(tmp_path / "bad"), "--no-progress", *bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    out = str(tmp_path / "cli")
    argv = ["--3d", "--out", out, "--count", "5", "--heldout-count", "3", "--points", "64", "--occupancy", "32",
            "--no-progress"]  # fmt: skip
    assert synth.main(argv) == 0
    assert synth.load_manifest(out)["args"] == {"count": 5, "heldout_count": 3, "points": 64, "occupancy": 32,
                                                "shard_size": 1000, "seed": 0}  # fmt: skip
    train = _read(out, "train")
    assert len(train) == 5 and len(_read(out, "heldout")) == 3
    assert _arr(train[0]["npy"]).shape == (64, 6) and _arr(train[0]["occ.npy"]).shape == (32, 7)
    assert T.ensure_3d(out, count=5, heldout_count=3, points=64, occupancy=32)["seconds"] == 0.0  # reused
