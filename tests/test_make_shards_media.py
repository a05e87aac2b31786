"""videos / meshes / conversations subcommands: samples readable by plain WebDataset, bad inputs reported."""

import glob
import io
import json
import os

import av
import numpy as np
import pytest
import trimesh
import webdataset as wds
from PIL import Image

from data import make_shards


def _run(kind, argv, capsys):
    rc = make_shards.main([kind, *argv, "--no-progress", "--workers", "1"])
    out, err = capsys.readouterr()
    last = out.strip().splitlines()[-1]
    return rc, {k: int(v) for k, v in (p.split(" = ") for p in last.split(", "))}, err


def _samples(out):
    urls = sorted(glob.glob(os.path.join(out, "*.tar")))
    return list(wds.WebDataset(urls, shardshuffle=False))


def _reasons(out):
    with open(os.path.join(out, "report.jsonl")) as f:
        return {os.path.basename(r["source"]): r["reason"] for r in map(json.loads, f)}


def _video(path, n=24, fps=24, size=32):
    with av.open(str(path), "w") as c:
        st = c.add_stream("mpeg4", rate=fps)
        st.width = st.height = size
        st.pix_fmt = "yuv420p"
        for i in range(n):
            a = np.zeros((size, size, 3), np.uint8)
            a[8:16, i % (size - 8): i % (size - 8) + 8] = (255, 40, 40)  # moving square
            for pkt in st.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                c.mux(pkt)
        for pkt in st.encode():
            c.mux(pkt)


def test_videos(tmp_path, capsys):
    d = tmp_path / "vids"
    d.mkdir()
    _video(d / "a.mp4")  # 1 s
    _video(d / "b.mp4", n=48)  # 2 s
    _video(d / "short.mp4", n=4)
    (d / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 definitely not a video")
    for n in ("a", "b", "short", "broken"):
        (d / f"{n}.txt").write_text(f"video {n}")
    out = tmp_path / "out"
    rc, s, _ = _run("videos", ["--input", str(d), "--out", str(out), "--fps", "12", "--frames", "6",
                               "--size", "16", "--clips-per-video", "0", "--shard-size", "3"], capsys)  # fmt: skip
    # a: 12 resampled frames -> 2 clips; b: 24 -> 4 clips
    assert rc == 0 and s == {"read": 4, "written": 2, "skipped": 2, "samples": 6}
    r = _reasons(out)
    assert r["broken.mp4"].startswith("unreadable video") and r["short.mp4"].startswith("too short")
    samples = _samples(out)
    assert len(glob.glob(str(out / "*.tar"))) == 2 and len(samples) == 6
    assert len({x["__key__"] for x in samples}) == 6
    for x in samples:
        meta = json.loads(x["json"])
        assert {"frames", "fps", "height", "width", "duration", "source", "start"} <= set(meta)
        assert (meta["frames"], meta["height"], meta["width"], meta["fps"]) == (6, 16, 16, 12)
        with av.open(io.BytesIO(x["mp4"])) as c:
            frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
        assert len(frames) == 6 and frames[0].shape == (16, 16, 3)
        assert x["txt"].decode().startswith("video ")
    starts = [json.loads(x["json"])["start"] for x in samples if x["txt"] == b"video b"]
    assert starts == pytest.approx([0, 0.5, 1.0, 1.5])

    # Manifest with start/end, a stride and a missing file.
    (tmp_path / "m.jsonl").write_text("\n".join([
        json.dumps({"path": "vids/b.mp4", "caption": "middle", "start": 0.5, "end": 1.5}),
        json.dumps({"path": "vids/nope.mp4", "caption": "gone"}),
    ]) + "\n")  # fmt: skip
    out2 = tmp_path / "out2"
    rc, s, _ = _run("videos", ["--input", str(tmp_path / "m.jsonl"), "--out", str(out2), "--fps", "12",
                               "--frames", "6", "--size", "16", "--clips-per-video", "0", "--stride", "0.25"],
                    capsys)  # fmt: skip
    assert rc == 0 and s == {"read": 2, "written": 1, "skipped": 1, "samples": 3}  # 12 frames, stride 3
    assert _reasons(out2) == {"nope.mp4": "missing file"}
    assert [json.loads(x["json"])["start"] for x in _samples(out2)] == pytest.approx([0.5, 0.75, 1.0])


def test_meshes(tmp_path, capsys):
    d = tmp_path / "meshes"
    d.mkdir()
    box = trimesh.creation.box(extents=(4, 2, 2))
    box.visual.face_colors = [255, 0, 0, 255]
    box.export(d / "box.ply")
    ico = trimesh.creation.icosphere(subdivisions=1)
    ico.visual.vertex_colors = [0, 255, 0, 255]
    ico.export(d / "ico.obj")
    trimesh.creation.box().export(d / "plain.stl")
    trimesh.Scene([trimesh.creation.box(), trimesh.creation.icosphere(subdivisions=1)]).export(d / "scene.glb")
    (d / "broken.ply").write_bytes(b"ply\nformat nonsense\n")
    for n in ("box", "ico", "plain", "scene", "broken"):
        (d / f"{n}.txt").write_text(f"a {n}")
    (d / "nocap.stl").write_bytes(trimesh.creation.box().export(file_type="stl"))
    out = tmp_path / "out"
    rc, s, _ = _run("meshes", ["--input", str(d), "--out", str(out), "--points", "128"], capsys)
    assert rc == 0 and s == {"read": 6, "written": 4, "skipped": 2}
    r = _reasons(out)
    assert r["broken.ply"].startswith("unreadable mesh") and r["nocap.stl"] == "missing caption"
    by = {x["txt"].decode(): x for x in _samples(out)}
    assert set(by) == {"a box", "a ico", "a plain", "a scene"}
    for name, x in by.items():
        pts = np.load(io.BytesIO(x["npy"]))
        assert pts.shape == (128, 6) and pts.dtype == np.float16
        assert np.abs(pts[:, :3]).max() <= 0.5 + 1e-3 and pts[:, 3:].min() >= 0 and pts[:, 3:].max() <= 1
        meta = json.loads(x["json"])
        assert {"vertices", "faces", "bounds", "scale", "source"} <= set(meta)
    assert np.allclose(np.load(io.BytesIO(by["a box"]["npy"]))[:, 3:], [1, 0, 0])
    assert np.allclose(np.load(io.BytesIO(by["a ico"]["npy"]))[:, 3:], [0, 1, 0])
    assert np.allclose(np.load(io.BytesIO(by["a plain"]["npy"]))[:, 3:], 0.7, atol=1e-3)
    assert json.loads(by["a box"]["json"])["scale"] == 4.0

    # Occupancy (default 2048 queries), in the cloud's normalised frame.
    for name, x in by.items():
        occ = np.load(io.BytesIO(x["occ.npy"]))
        assert occ.shape == (2048, 7) and occ.dtype == np.float16 and set(np.unique(occ[:, 3])) <= {0, 1}
        assert np.abs(occ[1024:, :3]).max() <= 0.55 + 1e-3  # the uniform half
        assert 0.25 < occ[:1024, 3].astype(float).mean() < 0.75, name  # the near-surface half: both sides
        assert json.loads(x["json"])["occupancy"] == 2048
        assert np.allclose(occ[:, 4:], np.load(io.BytesIO(x["npy"]))[0, 3:])  # one-colour meshes
    # The 4 x 2 x 2 box normalises to [-0.5, 0.5] x [-0.25, 0.25]^2: labels are that box exactly.
    occ = np.load(io.BytesIO(by["a box"]["occ.npy"])).astype(np.float64)
    inside = (np.abs(occ[:, :3]) < [0.5, 0.25, 0.25]).all(axis=1)
    assert (inside == (occ[:, 3] == 1)).mean() >= 0.999
    # The scene's box and sphere overlap: inside either one is inside.
    occ = np.load(io.BytesIO(by["a scene"]["occ.npy"])).astype(np.float64)
    assert occ[occ[:, 3] == 1].shape[0] > 100


def _write_obj(path, verts, faces):
    lines = [f"v {x} {y} {z}" for x, y, z in verts] + [f"f {a + 1} {b + 1} {c + 1}" for a, b, c in faces]
    path.write_text("\n".join(lines) + "\n")


def test_meshes_bad_geometry(tmp_path, capsys):
    d = tmp_path / "bad"
    d.mkdir()
    tet_v = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1)]
    tet_f = [(0, 2, 1), (0, 1, 3), (1, 2, 3), (2, 0, 3)]
    _write_obj(d / "good.obj", tet_v, tet_f)
    (d / "nofaces.obj").write_text("v 0 0 0\nv 1 0 0\nv 0 1 0\n")
    _write_obj(d / "flat.obj", [(0, 0, 0), (1, 0, 0), (2, 0, 0)], [(0, 1, 2)])  # collinear: zero area
    _write_obj(d / "nan.obj", [(0, 0, 0), (1, 0, 0), ("nan", 1, 0), (0, 0, 1)], tet_f)
    _write_obj(d / "inf.obj", [(0, 0, 0), (1, 0, 0), (0, "inf", 0), (0, 0, 1)], tet_f)
    # Three fins on one edge; written as STL, so every face has its own vertex copies.
    fins = trimesh.Trimesh([(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, -1, 0), (0, 0, 1)], [(0, 1, 2), (0, 1, 3), (0, 1, 4)],
                           process=False)  # fmt: skip
    fins.export(d / "fins.stl")
    for n in ("good", "nofaces", "flat", "nan", "inf", "fins"):
        (d / f"{n}.txt").write_text(f"a {n}")
    out = tmp_path / "out"
    rc, s, _ = _run("meshes", ["--input", str(d), "--out", str(out), "--points", "64", "--occupancy", "256"], capsys)
    assert rc == 0 and s == {"read": 6, "written": 1, "skipped": 5}
    r = _reasons(out)
    assert r["nofaces.obj"] == "no faces"
    assert r["flat.obj"].startswith("zero-area mesh")
    assert r["nan.obj"] == r["inf.obj"] == "non-finite vertices (NaN or inf)"
    assert r["fins.stl"].startswith("non-manifold mesh (an edge shared by 3 faces)")
    assert len(set(r.values())) == 4  # four distinct reasons (NaN and inf share one)
    (good,) = _samples(out)
    occ = np.load(io.BytesIO(good["occ.npy"]))
    assert occ.shape == (256, 7) and 0 < occ[:, 3].astype(float).sum() < 256

    # Without occupancy a non-manifold mesh is fine (its surface can still be sampled).
    out0 = tmp_path / "out0"
    rc, s, _ = _run("meshes", ["--input", str(d), "--out", str(out0), "--points", "64", "--occupancy", "0"], capsys)
    assert rc == 0 and s == {"read": 6, "written": 2, "skipped": 4}
    assert "fins.stl" not in _reasons(out0)
    for x in _samples(out0):
        assert "occ.npy" not in x and json.loads(x["json"])["occupancy"] == 0
        assert np.load(io.BytesIO(x["npy"])).shape == (64, 6)
    # The cloud does not depend on the occupancy setting.
    same = [x for x in _samples(out0) if x["txt"] == b"a good"][0]
    assert same["npy"] == good["npy"]


def test_winding_number():
    from data.sources.mesh import winding_number

    box = trimesh.creation.box(extents=(2, 2, 2))
    pts = np.array([[0, 0, 0], [0.9, 0.9, -0.9], [1.1, 0, 0], [0, 0, 5], [-0.99, 0.5, 0.2]])
    w = winding_number(box.triangles, pts)
    assert np.allclose(w, [1, 1, 0, 0, 1], atol=1e-9)
    assert np.allclose(winding_number(box.triangles[:, ::-1], pts), -w)  # flipped orientation
    # An open box (one face, i.e. 2 triangles, missing) still reads as mostly inside near its centre.
    wo = winding_number(box.triangles[2:], pts[:1])
    assert 0.5 < wo[0] < 1
    # Chunking does not change the result.
    q = np.random.default_rng(0).uniform(-1.5, 1.5, (300, 3))
    assert np.allclose(winding_number(box.triangles, q, chunk_elems=7), winding_number(box.triangles, q))
    assert winding_number(np.zeros((0, 3, 3)), q).tolist() == [0.0] * 300


def test_conversations(tmp_path, capsys):
    d = tmp_path / "vqa"
    d.mkdir()
    for n, (w, h) in {"a.png": (40, 30), "b.png": (30, 50)}.items():
        Image.new("RGB", (w, h), (10, 200, 30)).save(d / n)
    (d / "junk.jpg").write_bytes(b"no")
    turn = [{"from": "human", "value": "<image>\nWhat colour?"}, {"from": "gpt", "value": "Green."}]
    rows = [
        json.dumps({"id": "x1", "image": "a.png", "conversations": turn}),
        json.dumps({"images": ["a.png", "b.png"], "turns": [{"role": "user", "content": "Compare."},
                                                            {"role": "assistant", "content": "Same."}]}),
        "{bad json",
        json.dumps({"image": "missing.png", "conversations": turn}),
        json.dumps({"image": "a.png", "conversations": []}),
        json.dumps({"image": "a.png", "conversations": [{"from": "robot", "value": "hi"}]}),
        json.dumps({"conversations": turn}),
        json.dumps({"image": "junk.jpg", "conversations": turn}),
    ]
    (d / "conv.jsonl").write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    rc, s, _ = _run("conversations", ["--input", str(d / "conv.jsonl"), "--out", str(out), "--size", "16"], capsys)
    assert rc == 0 and s == {"read": 8, "written": 2, "skipped": 6}
    reasons = sorted(_reasons(out).values())
    assert sum(r.startswith("malformed row") for r in reasons) == 4
    assert sum("missing file" in r for r in reasons) == 1 and sum("unreadable image" in r for r in reasons) == 1
    one, two = _samples(out)
    meta = json.loads(one["json"])
    assert meta["turns"] == [{"role": "user", "content": "<image>\nWhat colour?"},
                             {"role": "assistant", "content": "Green."}] and meta["id"] == "x1"  # fmt: skip
    assert Image.open(io.BytesIO(one["jpg"])).size == (16, 16)
    assert json.loads(two["json"])["images"] == 2 and "0.jpg" in two and "1.jpg" in two


def test_help_and_all_failed(tmp_path, capsys):
    for kind, flags in {"videos": ("--fps", "--frames", "--clips-per-video", "--stride", "mp4"),
                        "meshes": ("--points", "npy", "--occupancy", "occ.npy", "non-manifold"),
                        "conversations": ("conversations", "--size")}.items():
        with pytest.raises(SystemExit) as e:
            make_shards.main([kind, "--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        assert all(f in text for f in (*flags, "--workers", "--shard-size", "--report", "Resumable"))
    d = tmp_path / "bad"
    d.mkdir()
    (d / "x.obj").write_text("nothing here\n")
    (d / "x.txt").write_text("cap")
    rc, s, err = _run("meshes", ["--input", str(d), "--out", str(tmp_path / "o")], capsys)
    assert rc == 1 and s == {"read": 1, "written": 0, "skipped": 1} and "all 1 inputs failed" in err
