"""Media -> shards conversion: every input form, bad inputs accounted for, readable output."""

import glob
import io
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from PIL import Image

from data import make_shards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _img(path, w, h, mode="RGB", fmt=None):
    rng = np.random.default_rng(w * 1000 + h)
    arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    im = Image.fromarray(arr).convert(mode)
    im.save(path, format=fmt)
    return path


def _good_jpeg_bytes():
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 10, 10)).save(buf, format="JPEG")
    return buf.getvalue()


def _run(argv, capsys):
    rc = make_shards.main(["images", *argv, "--no-progress", "--workers", "1"])
    out, err = capsys.readouterr()
    return rc, out, err


def _summary(stdout):
    last = stdout.strip().splitlines()[-1]
    parts = dict(p.split(" = ") for p in last.split(", "))
    return {k: int(v) for k, v in parts.items()}


def _samples(out):
    urls = sorted(glob.glob(os.path.join(out, "*.tar")))
    return list(wds.WebDataset(urls, shardshuffle=False)) if urls else []


def _report(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    goods = [
        _img(d / "wide.png", 90, 50),
        _img(d / "tall.jpg", 30, 70),
        _img(d / "sub" / "rgba.png", 64, 64, mode="RGBA"),
        _img(d / "palette.gif", 48, 40, mode="P"),
        _img(d / "tiny.bmp", 10, 12),  # upscaled to the requested size
    ]
    for i, g in enumerate(goods):
        g.with_suffix(".txt").write_text(f"caption number {i}\n")
    _img(d / "nocap.png", 40, 40)  # no sidecar
    _img(d / "emptycap.png", 40, 40)
    (d / "emptycap.txt").write_text("   \n")
    (d / "garbage.jpg").write_bytes(b"this is not an image at all")
    (d / "garbage.txt").write_text("garbage")
    full = _good_jpeg_bytes()
    (d / "truncated.jpg").write_bytes(full[: len(full) // 2])
    (d / "truncated.txt").write_text("truncated")
    (d / "orphan.txt").write_text("a caption whose image is gone")
    (d / "notes.md").write_text("ignored: neither image nor caption")
    return d


def test_folder_with_sidecars(folder, tmp_path, capsys):
    out = tmp_path / "out"
    rc, stdout, _ = _run(["--input", str(folder), "--out", str(out), "--size", "32"], capsys)
    assert rc == 0
    s = _summary(stdout)
    assert s == {"read": 10, "written": 5, "skipped": 5}
    assert s["read"] == s["written"] + s["skipped"]
    rep = {os.path.basename(r["source"]): r["reason"] for r in _report(out / "report.jsonl")}
    assert rep["nocap.png"] == "missing caption" and rep["emptycap.png"] == "missing caption"
    assert rep["garbage.jpg"].startswith("unreadable image")
    assert rep["truncated.jpg"].startswith("unreadable image")
    assert rep["orphan.txt"] == "caption without image"
    assert len(rep) == 5
    samples = _samples(out)
    assert len(samples) == 5
    for smp in samples:
        im = Image.open(io.BytesIO(smp["jpg"]))
        meta = json.loads(smp["json"])
        assert im.size == (32, 32) and im.mode == "RGB" and meta["size"] == [32, 32]
        assert os.path.isfile(meta["source"])
        assert smp["txt"].decode().startswith("caption number")
    by_name = {os.path.basename(json.loads(x["json"])["source"]): json.loads(x["json"]) for x in samples}
    assert by_name["wide.png"]["original_size"] == [90, 50]
    assert by_name["tiny.bmp"]["original_size"] == [10, 12]


def test_crop_none_png_and_workers(folder, tmp_path, capsys):
    out = tmp_path / "out"
    rc = make_shards.main(["images", "--input", str(folder), "--out", str(out), "--size", "24",
                           "--crop", "none", "--format", "png", "--workers", "2", "--shard-size", "2",
                           "--no-progress", "--report", str(tmp_path / "r.jsonl")])  # fmt: skip
    stdout, _ = capsys.readouterr()
    assert rc == 0 and _summary(stdout)["written"] == 5
    assert len(_report(tmp_path / "r.jsonl")) == 5
    assert len(glob.glob(str(out / "*.tar"))) == 3  # 5 samples, 2 per shard
    samples = _samples(out)
    keys = [x["__key__"] for x in samples]
    assert keys == sorted(keys)  # the pool keeps input order
    for smp in samples:
        im = Image.open(io.BytesIO(smp["png"]))
        w, h = json.loads(smp["json"])["original_size"]
        assert min(im.size) == 24
        assert abs(im.size[0] / im.size[1] - w / h) < 0.1  # aspect ratio kept
    # A rerun with bigger shards must not leave the old shard-000001/2 behind.
    assert make_shards.main(["images", "--input", str(folder), "--out", str(out), "--size", "24",
                             "--no-progress", "--workers", "1"]) == 0  # fmt: skip
    assert "removed 3 shard(s)" in capsys.readouterr().err
    assert len(glob.glob(str(out / "*.tar"))) == 1


def test_metadata_jsonl_folder(tmp_path, capsys):
    d = tmp_path / "hf"
    (d / "imgs").mkdir(parents=True)
    _img(d / "imgs" / "a.png", 50, 40)
    _img(d / "b.jpg", 40, 50)
    _img(d / "nocap.png", 40, 40)
    rows = [
        json.dumps({"file_name": "imgs/a.png", "text": "first"}),
        json.dumps({"file_name": "b.jpg", "text": "second"}),
        json.dumps({"file_name": "missing.png", "text": "gone"}),
        "{not json",
        json.dumps({"file_name": "nocap.png"}),
        json.dumps({"text": "no path"}),
        "",
    ]
    (d / "metadata.jsonl").write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    rc, stdout, _ = _run(["--input", str(d), "--out", str(out), "--size", "16"], capsys)
    assert rc == 0
    assert _summary(stdout) == {"read": 6, "written": 2, "skipped": 4}
    reasons = sorted(r["reason"].split(":")[0] for r in _report(out / "report.jsonl"))
    assert reasons == ["malformed manifest row", "malformed manifest row", "missing caption", "missing file"]
    samples = _samples(out)
    assert [x["txt"].decode() for x in samples] == ["first", "second"]
    assert all(Image.open(io.BytesIO(x["jpg"])).size == (16, 16) for x in samples)


def test_csv_manifest(tmp_path, capsys):
    d = tmp_path / "csv"
    (d / "pics").mkdir(parents=True)
    _img(d / "pics" / "x.png", 60, 30)
    _img(d / "pics" / "y.png", 30, 60)
    (d / "pics" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\nbroken")
    (d / "list.csv").write_text(
        "path,caption\n"
        "pics/x.png,a wide picture\n"
        'pics/y.png,"a tall picture, with a comma"\n'
        "pics/bad.png,broken\n"
        "pics/none.png,missing\n"
        "pics/x.png,\n"
        "pics/x.png,too,many\n"
    )
    out = tmp_path / "out"
    rc, stdout, _ = _run(["--input", str(d / "list.csv"), "--out", str(out), "--size", "20"], capsys)
    assert rc == 0
    s = _summary(stdout)
    assert s == {"read": 6, "written": 2, "skipped": 4}
    reasons = sorted(r["reason"].split(":")[0] for r in _report(out / "report.jsonl"))
    assert reasons == ["malformed manifest row", "missing caption", "missing file", "unreadable image"]
    samples = _samples(out)
    assert samples[1]["txt"].decode() == "a tall picture, with a comma"
    assert all(Image.open(io.BytesIO(x["jpg"])).size == (20, 20) for x in samples)


def test_parquet_manifest_paths_and_inline_bytes(tmp_path, capsys):
    d = tmp_path / "pq"
    d.mkdir()
    _img(d / "p.png", 40, 40)
    pq.write_table(pa.table({"file_name": ["p.png", "q.png", None], "text": ["ok", "gone", "no path"]}),
                   d / "m.parquet")  # fmt: skip
    out = tmp_path / "out"
    rc, stdout, _ = _run(["--input", str(d / "m.parquet"), "--out", str(out), "--size", "8"], capsys)
    assert rc == 0 and _summary(stdout) == {"read": 3, "written": 1, "skipped": 2}
    assert Image.open(io.BytesIO(_samples(out)[0]["jpg"])).size == (8, 8)
    # Hugging Face datasets store images inline as {"bytes", "path"} structs.
    img_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    images = pa.array([{"bytes": _good_jpeg_bytes(), "path": "r.jpg"}, {"bytes": b"junk", "path": "s.jpg"}],
                      type=img_type)  # fmt: skip
    pq.write_table(pa.table({"image": images, "caption": ["red", "junk"]}), d / "hf.parquet")
    out2 = tmp_path / "out2"
    rc, stdout, _ = _run(["--input", str(d / "hf.parquet"), "--out", str(out2), "--size", "8"], capsys)
    assert rc == 0 and _summary(stdout) == {"read": 2, "written": 1, "skipped": 1}
    assert _samples(out2)[0]["txt"] == b"red"


def test_all_bad_and_missing_input_fail_cleanly(tmp_path, capsys):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "a.jpg").write_bytes(b"nope")
    (d / "a.txt").write_text("cap")
    _img(d / "b.png", 20, 20)  # no caption
    out = tmp_path / "out"
    rc, stdout, err = _run(["--input", str(d), "--out", str(out)], capsys)
    assert rc == 1 and _summary(stdout) == {"read": 2, "written": 0, "skipped": 2}
    assert "all 2 inputs failed" in err and "Traceback" not in err
    assert glob.glob(str(out / "*.tar")) == []  # no empty shard left behind
    rc, _, err = _run(["--input", str(tmp_path / "nowhere"), "--out", str(out)], capsys)
    assert rc == 2 and "does not exist" in err
    (tmp_path / "cols.csv").write_text("file,label\nx.png,y\n")
    rc, _, err = _run(["--input", str(tmp_path / "cols.csv"), "--out", str(out)], capsys)
    assert rc == 2 and "path column" in err


def test_cli_subprocess(folder, tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    h = subprocess.run([sys.executable, "-m", "data.make_shards", "images", "--help"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert h.returncode == 0
    for flag in ("--input", "--out", "--size", "--crop", "--shard-size", "--workers", "--report", "metadata.jsonl"):
        assert flag in h.stdout
    r = subprocess.run([sys.executable, "-m", "data.make_shards", "images", "--input", str(folder),
                        "--out", str(tmp_path / "o"), "--size", "16", "--workers", "2"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "read = 10, written = 5, skipped = 5"
    bad = subprocess.run([sys.executable, "-m", "data.make_shards", "images", "--input",
                          str(tmp_path / "missing"), "--out", str(tmp_path / "o2")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [f"error: input path {tmp_path / 'missing'} does not exist"]


# ------------------------------------------------------------------------------------ resumability
def _tar_bytes(out):
    return {os.path.basename(p): open(p, "rb").read() for p in sorted(glob.glob(os.path.join(out, "*.tar")))}


def test_resume_after_kill_matches_uninterrupted_run(folder, tmp_path, capsys):
    for i in range(6):  # more good inputs, so that several shards exist
        _img(folder / f"extra{i}.png", 20 + i, 30).with_suffix(".txt").write_text(f"extra {i}")
    args = ["images", "--input", str(folder), "--size", "16", "--shard-size", "2", "--no-progress"]
    ref = tmp_path / "ref"
    assert make_shards.main([*args, "--out", str(ref), "--workers", "1"]) == 0
    ref_summary = _summary(capsys.readouterr().out)
    assert ref_summary == {"read": 16, "written": 11, "skipped": 5}

    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": ROOT, make_shards.KILL_ENV: "2"}
    r = subprocess.run([sys.executable, "-m", "data.make_shards", *args, "--out", str(out), "--workers", "1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == -9, r.stderr  # SIGKILLed right after its second shard was final
    assert sorted(os.listdir(out)) == ["report.jsonl", "shard-000000.tar", "shard-000000.tar.json",
                                       "shard-000001.tar", "shard-000001.tar.json"]  # fmt: skip
    first = _tar_bytes(out)
    assert make_shards.main([*args, "--out", str(out), "--workers", "2"]) == 0
    stdout, err = capsys.readouterr()
    assert "resuming: kept 2 finished shard(s)" in err
    assert _summary(stdout) == ref_summary
    got = _tar_bytes(out)
    assert {k: got[k] for k in first} == first  # finished shards were not rewritten
    assert got == _tar_bytes(ref)  # byte-identical to the uninterrupted run
    samples = _samples(out)
    keys = [x["__key__"] for x in samples]
    assert len(keys) == len(set(keys)) == 11
    assert sorted(r["source"] for r in _report(out / "report.jsonl")) == \
        sorted(r["source"] for r in _report(ref / "report.jsonl"))  # fmt: skip
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]

    # A finished run re-run as is writes nothing new; other options start over.
    assert make_shards.main([*args, "--out", str(out), "--workers", "1"]) == 0
    stdout, err = capsys.readouterr()
    assert "kept 6 finished shard(s)" in err and _summary(stdout) == ref_summary and _tar_bytes(out) == got
    assert make_shards.main([*args[:-3], "--shard-size", "3", "--no-progress", "--out", str(out)]) == 0
    assert "removed 6 shard(s)" in capsys.readouterr().err
    assert len(_samples(out)) == 11 and len(glob.glob(str(out / "*.tar"))) == 4


class _MultiWork:
    """3 samples per input, every 4th input bad; optionally fails at input `fail_at` (a crash)."""

    def __init__(self, fail_at=None):
        self.fail_at = fail_at

    def __call__(self, item):
        if item.index == self.fail_at:
            raise RuntimeError("injected crash")
        if item.index % 4 == 3:
            item.error = "bad"
            return item, None
        return item, [{"__key__": f"{item.index:04d}-{c}", "txt": f"{item.index} {c}"} for c in range(3)]


def test_resume_with_inputs_straddling_shards(tmp_path):
    items = lambda: [make_shards.Item(i, f"in{i}") for i in range(11)]  # noqa: E731
    ref = make_shards.convert(items(), _MultiWork(), str(tmp_path / "ref"), shard_size=2, progress=False)
    assert (ref["read"], ref["written"], ref["skipped"], ref["samples"]) == (11, 9, 2, 27)
    out = str(tmp_path / "out")
    with pytest.raises(RuntimeError):
        make_shards.convert(items(), _MultiWork(fail_at=6), out, shard_size=2, progress=False)
    assert len(glob.glob(os.path.join(out, "*.tar"))) == 7 and glob.glob(os.path.join(out, "*.tmp"))
    res = make_shards.convert(items(), _MultiWork(), out, shard_size=2, progress=False)
    assert res["resumed_shards"] == 7
    assert {k: res[k] for k in ("read", "written", "skipped", "samples", "shards")} == \
        {k: ref[k] for k in ("read", "written", "skipped", "samples", "shards")}  # fmt: skip
    assert _tar_bytes(out) == _tar_bytes(str(tmp_path / "ref"))
    keys = [x["__key__"] for x in _samples(out)]
    assert len(keys) == len(set(keys)) == 27
