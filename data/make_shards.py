"""Convert raw media plus captions into WebDataset shards.

    python -m data.make_shards images        --input PATH --out DIR [--size 256] [--crop center]
    python -m data.make_shards videos        --input PATH --out DIR [--fps 8 --frames 16 --size 256]
    python -m data.make_shards meshes        --input PATH --out DIR [--points 4096 --occupancy 2048]
    python -m data.make_shards conversations --input FILE.jsonl --out DIR [--size 256]

One subcommand per media kind, all sharing `convert` (resumable; see its docstring). Sample
formats: in the docstrings of data/sources/ (image, video, mesh, conversation). Every input is
accounted for: it is either written or skipped with a reason in the report (JSONL), and the last
line reads `read = N, written = W, skipped = S` with read == written + skipped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict

import webdataset as wds
from tqdm import tqdm

from data.sources.common import InputError, Item, media_items  # noqa: F401 (re-exported)
from data.sources.image import ImageOpts, ImageWork, image_items

# ----------------------------------------------------------------------------------- conversion
SHARD_PATTERN = "shard-%06d.tar"
_OURS = re.compile(r"shard-\d{6}\.tar(\.json)?(\.tmp)?")
KILL_ENV = "MAKE_SHARDS_TEST_KILL_AFTER_SHARDS"  # test hook: SIGKILL self once N shards are final


def _fingerprint(config: dict, items: list[Item], shard_size: int) -> str:
    """Identity of a conversion: options, shard size and the enumerated inputs, in order."""
    h = hashlib.sha256()
    h.update(json.dumps({"config": config, "shard_size": shard_size}, sort_keys=True, default=str).encode())
    for it in items:
        h.update(f"\n{it.index}\t{it.source}\t{len(it.data) if it.data is not None else -1}".encode())
    return h.hexdigest()[:32]


def _finished_prefix(out: str, fp: str) -> list[dict]:
    """Sidecars of the shards 0..k-1 a run with the same fingerprint finished (chained by position)."""
    done, pos = [], [0, 0]
    while True:
        tar = os.path.join(out, SHARD_PATTERN % len(done))
        try:
            with open(tar + ".json") as f:
                meta = json.load(f)
        except (OSError, ValueError):
            break
        if not os.path.isfile(tar) or meta.get("fingerprint") != fp or meta.get("start") != pos:
            break
        done.append(meta)
        pos = meta["end"]
    return done


def _write_json_atomic(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, sort_keys=True)
    os.replace(path + ".tmp", path)


def convert(
    items: Iterator[Item],
    work: Callable[[Item], tuple[Item, dict | list[dict] | None]],
    out: str,
    shard_size: int = 1000,
    workers: int = 1,
    report: str | None = None,
    progress: bool = True,
    config: dict | None = None,
    unit: str = "input",
) -> dict:
    """Run `work` over `items` (in a pool when workers > 1, order kept) and write shards to `out`.

    Media-agnostic: a subcommand supplies its items, its `work` (one input -> one sample, a list of
    samples, or None with `item.error` set) and its options as `config`.

    Resumable: inputs are enumerated in a fixed order and processed deterministically, so the
    stream of samples, and the cut into shards of `shard_size` samples, is the same on every run.
    Shard k is written to shard-k.tar.tmp; when full, its sidecar shard-k.tar.json (fingerprint,
    the stream positions [input, sample offset] where it starts and ends, per-shard read / written
    / skipped counts and skip reasons) is written, then the .tar.tmp is renamed to .tar. A re-run
    with the same inputs and options keeps the finished prefix of shards, restarts the stream
    where the last one ended, and so never writes a sample twice; other files with our naming
    (partial .tmp, shards of a different run) are removed. Counts of kept shards come from their
    sidecars, so the summary still covers every input: read == written + skipped.

    Returns {"read", "written", "skipped", "samples", "shards", "resumed_shards", "report"}.
    """
    os.makedirs(out, exist_ok=True)
    report = report or os.path.join(out, "report.jsonl")
    items = list(items)  # known total for the progress bar; manifests hold paths, not pixels
    fp = _fingerprint(config or {}, items, shard_size)
    done = _finished_prefix(out, fp)
    keep = {SHARD_PATTERN % k + sfx for k in range(len(done)) for sfx in ("", ".json")}
    stale = sorted(f for f in os.listdir(out) if _OURS.fullmatch(f) and f not in keep)
    for f in stale:
        os.remove(os.path.join(out, f))
    n_stale = sum(f.endswith(".tar") for f in stale)
    if n_stale:  # loaders read every *.tar in the folder: an older run's shards must not join
        print(f"note: removed {n_stale} shard(s) of an earlier run in {out}", file=sys.stderr)
    start = done[-1]["end"] if done else [0, 0]
    if done:
        print(f"note: resuming: kept {len(done)} finished shard(s), restarting at input {start[0]} "
              f"of {len(items)}", file=sys.stderr)  # fmt: skip
    tot = {k: sum(d[k] for d in done) for k in ("read", "written", "skipped", "samples")}
    kill_after = int(os.environ.get(KILL_ENV, "0") or 0)

    shard = len(done)
    prev_end = list(start)  # a shard starts where the previous one ended (chain checked on resume)
    cur = None  # the open shard: writer, start position, counts, skip records

    def new_shard(pos):
        path = os.path.join(out, SHARD_PATTERN % shard) + ".tmp"
        w = wds.TarWriter(path, mtime=0.0, user="wds", group="wds")  # fixed header: reproducible bytes
        return {"writer": w, "start": list(pos), "read": 0, "written": 0, "skipped": 0, "samples": 0, "skips": []}

    def finish_shard(end):
        nonlocal cur, shard, prev_end
        cur["writer"].close()
        tar = os.path.join(out, SHARD_PATTERN % shard)
        side = {k: cur[k] for k in ("start", "read", "written", "skipped", "samples")}
        side.update(fingerprint=fp, shard=shard, end=list(end), skips=cur["skips"])
        _write_json_atomic(tar + ".json", side)  # sidecar first: a .tar without one is not trusted
        os.replace(tar + ".tmp", tar)
        shard += 1
        prev_end = list(end)
        cur = None

    todo = items[start[0]:]
    pool = mp.Pool(workers) if workers > 1 and len(todo) > 1 else None
    run_shards = 0
    try:
        results = pool.imap(work, todo, chunksize=4) if pool else map(work, todo)
        with open(report, "w") as rep:
            for d in done:
                for s in d["skips"]:
                    rep.write(json.dumps(s) + "\n")
            pending = {"read": 0, "written": 0, "skipped": 0, "skips": []}  # inputs not yet in a shard
            for p, (item, res) in enumerate(tqdm(results, total=len(todo), unit=unit, disable=not progress),
                                            start=start[0]):  # fmt: skip
                samples = [res] if isinstance(res, dict) else list(res or [])
                if not samples:
                    rec = {"index": item.index, "source": item.source, "reason": item.error or "no samples"}
                    rep.write(json.dumps(rec) + "\n")
                    rep.flush()
                    tgt = cur if cur is not None else pending
                    tgt["read"] += 1
                    tgt["skipped"] += 1
                    tgt["skips"].append(rec)
                    continue
                offset = start[1] if p == start[0] else 0  # samples of this input already in a kept shard
                for j in range(offset, len(samples)):
                    if cur is None:
                        cur = new_shard(prev_end)
                        for k in ("read", "written", "skipped", "skips"):
                            cur[k] += pending[k]
                        pending = {"read": 0, "written": 0, "skipped": 0, "skips": []}
                    cur["writer"].write(samples[j])
                    cur["samples"] += 1
                    tot["samples"] += 1
                    last = j == len(samples) - 1
                    if last:
                        cur["read"] += 1
                        cur["written"] += 1
                    if cur["samples"] >= shard_size:
                        finish_shard([p + 1, 0] if last else [p, j + 1])
                        run_shards += 1
                    if kill_after and run_shards >= kill_after:
                        os.kill(os.getpid(), signal.SIGKILL)
            if cur is not None:
                finish_shard([len(items), 0])
            run_pending = pending
    finally:
        if pool:  # terminate, not close: on Ctrl-C or an error the queued work is not wanted
            pool.terminate()
            pool.join()
        if cur is not None:  # interrupted: the partial shard stays .tmp and is redone on re-run
            cur["writer"].close()
    for d in _finished_prefix(out, fp)[len(done):]:
        for k in ("read", "written", "skipped"):
            tot[k] += d[k]
    for k in ("read", "written", "skipped"):
        tot[k] += run_pending[k]
    return {**tot, "shards": shard, "resumed_shards": len(done), "report": report}

def images_main(a: argparse.Namespace) -> dict:
    opts = ImageOpts(size=a.size, crop=a.crop, fmt=a.format, quality=a.quality, min_size=a.min_size)
    return convert(image_items(a.input), ImageWork(opts), a.out, a.shard_size, a.workers, a.report,
                   progress=not a.no_progress, config={"kind": "images", **asdict(opts)}, unit="img")  # fmt: skip


def videos_main(a: argparse.Namespace) -> dict:
    from data.sources.video import VIDEO_EXTS, VideoOpts, VideoWork

    opts = VideoOpts(fps=a.fps, frames=a.frames, size=a.size, crop=a.crop, clips_per_video=a.clips_per_video,
                     stride=a.stride, crf=a.crf)  # fmt: skip
    return convert(media_items(a.input, VIDEO_EXTS, "video"), VideoWork(opts), a.out, a.shard_size, a.workers,
                   a.report, progress=not a.no_progress, config={"kind": "videos", **asdict(opts)},
                   unit="video")  # fmt: skip


def meshes_main(a: argparse.Namespace) -> dict:
    from data.sources.mesh import MESH_EXTS, MeshOpts, MeshWork

    opts = MeshOpts(points=a.points, default_color=tuple(a.default_color), occupancy=a.occupancy)
    return convert(media_items(a.input, MESH_EXTS, "mesh"), MeshWork(opts), a.out, a.shard_size, a.workers,
                   a.report, progress=not a.no_progress, config={"kind": "meshes", **asdict(opts)},
                   unit="mesh")  # fmt: skip


def conversations_main(a: argparse.Namespace) -> dict:
    from data.sources.conversation import ConversationWork, conversation_items

    opts = ImageOpts(size=a.size, crop=a.crop, fmt=a.format, quality=a.quality, min_size=a.min_size)
    return convert(conversation_items(a.input), ConversationWork(opts), a.out, a.shard_size, a.workers,
                   a.report, progress=not a.no_progress, config={"kind": "conversations", **asdict(opts)},
                   unit="conv")  # fmt: skip


# ------------------------------------------------------------------------------------------- CLI
def _common_args(p: argparse.ArgumentParser, input_help: str) -> None:
    p.add_argument("--input", required=True, help=input_help)
    p.add_argument("--out", required=True, help="output folder for shard-%%06d.tar and the report")
    p.add_argument("--shard-size", type=int, default=1000, help="samples per shard (default 1000)")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1) - 1),
                   help="decode processes; 1 runs in-process (default: CPUs - 1)")
    p.add_argument("--report", default=None, help="JSONL of skipped inputs (default OUT/report.jsonl)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _image_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", type=int, default=256,
                   help="resize so the shorter side is SIZE px (upscales small images; 0 keeps the "
                   "original size) (default 256)")  # fmt: skip
    p.add_argument("--crop", choices=("center", "none"), default="center",
                   help="center: centre-crop to SIZE x SIZE; none: keep the aspect ratio (default center)")
    p.add_argument("--format", choices=("jpg", "png"), default="jpg",
                   help="re-encoding: jpg (quality --quality, 4:4:4 chroma) or lossless png (default jpg)")
    p.add_argument("--quality", type=int, default=95, help="JPEG quality (default 95)")
    p.add_argument("--min-size", type=int, default=0,
                   help="skip images whose shorter side is below this many px (default 0: keep all)")


RESUME_NOTE = (" Resumable: re-running the same command after an interruption keeps the finished "
               "shards (shard-N.tar + shard-N.tar.json) and writes only the rest.")
MANIFEST_NOTE = ("Input forms: a folder of files with same-stem .txt captions; a folder holding "
                 "metadata.jsonl; or a .csv/.parquet/.jsonl manifest with a path column "
                 "(path/file_name/image) and a caption column (caption/text), paths relative to the "
                 "manifest's folder.")



def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m data.make_shards",
        description="Convert raw media + captions into WebDataset shards (shard-%06d.tar). "
        "Bad inputs are skipped and listed with their reason in a JSONL report.",
    )
    sub = p.add_subparsers(dest="kind", required=True, metavar="{images,videos,meshes,conversations}")
    im = sub.add_parser(
        "images",
        help="images with captions",
        description="Input forms: (a) a folder of images with same-stem .txt captions; (b) a folder "
        "holding metadata.jsonl with file_name and text (Hugging Face ImageFolder); (c) a .csv, "
        ".parquet or .jsonl manifest with a path column (path/file_name/image) and a caption "
        "column (caption/text), paths relative to the manifest's folder. Each sample gets "
        "__key__, jpg (or png), txt and json (source, original_size, size)." + RESUME_NOTE,
    )
    _common_args(im, "folder or manifest file (see above)")
    _image_args(im)
    im.set_defaults(run=images_main)

    vd = sub.add_parser("videos", help="video clips with captions (PyAV)",
                        description=MANIFEST_NOTE + " Manifest rows may add start/end (seconds) to cut "
                        "clips from that span only. Each clip sample gets __key__, mp4 (H.264), txt "
                        "and json (frames, fps, height, width, duration, source, start); videos "
                        "yielding no full clip are skipped as too short." + RESUME_NOTE)  # fmt: skip
    _common_args(vd, "folder or manifest file (see above)")
    vd.add_argument("--fps", type=float, default=8.0, help="resample clips to this frame rate (default 8)")
    vd.add_argument("--frames", type=int, default=16, help="frames per clip (default 16)")
    vd.add_argument("--size", type=int, default=256,
                    help="shorter side in px, 0 keeps the original (default 256)")
    vd.add_argument("--crop", choices=("center", "none"), default="center",
                    help="center: centre-crop to SIZE x SIZE; none: keep the aspect ratio")
    vd.add_argument("--clips-per-video", type=int, default=1,
                    help="at most this many clips per video, 0 for all (default 1)")
    vd.add_argument("--stride", type=float, default=0.0,
                    help="seconds between clip starts; 0: back-to-back clips (default 0)")
    vd.add_argument("--crf", type=int, default=23, help="libx264 constant rate factor (default 23)")
    vd.set_defaults(run=videos_main)

    ms = sub.add_parser("meshes", help="meshes to coloured point clouds (trimesh)",
                        description=MANIFEST_NOTE + " Mesh files: .obj .ply .glb .gltf .stl .off. Each "
                        "sample gets __key__, npy (N, 6) float16 xyz+rgb with xyz in the unit cube "
                        "[-0.5, 0.5]^3, occ.npy (Q, 7) float16 xyz, occupancy, rgb (half near the "
                        "surface, half uniform in [-0.55, 0.55]^3; inside by the generalized winding "
                        "number), txt and json (vertices, faces, bounds, center, scale, source). "
                        "Meshes without faces, of zero area or with NaN/inf vertices are skipped, and "
                        "with occupancy also non-manifold ones. No rendered views." + RESUME_NOTE)  # fmt: skip
    _common_args(ms, "folder or manifest file (see above)")
    ms.add_argument("--points", type=int, default=4096, help="points sampled per mesh (default 4096)")
    ms.add_argument("--occupancy", type=int, default=2048,
                    help="occupancy queries per mesh in occ.npy; 0: no occ.npy (default 2048)")
    ms.add_argument("--default-color", type=float, nargs=3, default=[0.7, 0.7, 0.7], metavar=("R", "G", "B"),
                    help="rgb in [0, 1] for meshes without colours (default 0.7 0.7 0.7)")
    ms.set_defaults(run=meshes_main)

    cv = sub.add_parser("conversations", help="image conversations (VLM instruction data)",
                        description="Input: a .jsonl with per row an image path (image/images, str or "
                        "list, relative to the file's folder) and conversations/turns: "
                        "[{from/role: human/user/gpt/assistant/system, value/content: str}]. Each "
                        "sample gets __key__, jpg (0.jpg, 1.jpg, ... for several images) and json "
                        "(turns as role/content, images, sizes, source)." + RESUME_NOTE)  # fmt: skip
    _common_args(cv, "conversation .jsonl file")
    _image_args(cv)
    cv.set_defaults(run=conversations_main)
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    for name in ("size", "shard_size", "workers", "quality", "frames", "fps", "points", "clips_per_video",
                 "occupancy"):
        v = getattr(a, name, None)
        if v is not None and (v < 0 if name in ("size", "clips_per_video", "occupancy") else v <= 0):
            print(f"error: --{name.replace('_', '-')} must be positive, got {v}", file=sys.stderr)
            return 2
    try:
        r = a.run(a)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    extra = f", samples = {r['samples']}" if r["samples"] != r["written"] else ""
    print(f"read = {r['read']}, written = {r['written']}, skipped = {r['skipped']}{extra}")
    if r["read"] == 0:
        print(f"error: no inputs found in {a.input}", file=sys.stderr)
        return 1
    if r["written"] == 0:
        print(f"error: all {r['read']} inputs failed; reasons in {r['report']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
