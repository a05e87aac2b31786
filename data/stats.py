"""Dataset statistics for WebDataset shards: counts, histograms, duplicates, corrupt samples.

    python -m data.stats SHARDS --out DIR [--workers N] [--verify]

Writes DIR/stats.json (everything, machine-readable), DIR/report.md (Markdown tables) and PNG
histograms referenced from the report. Per sample it reads:

* member types and their bytes (`png`, `jpg`, `txt`, `json`, `latent.npy`, ...);
* resolution from the json metadata (`width`/`height`, or `size`/`original_size` as [w, h]),
  else from the image header (PIL opens lazily: no pixel decode unless --verify);
* duration / frame count of videos from json `duration`, `frames` (or `num_frames`), `fps`;
* caption length in words and characters (`txt`);
* sha1 of the media bytes, for duplicate groups.

A sample is corrupt when its image header (or, with --verify, its pixels) cannot be read, its json
does not parse, or it has no media member; a shard that cannot be read to the end counts as a
corrupt shard. Nothing here is fatal: everything is counted and listed.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import multiprocessing as mp
import os
import sys
from collections import Counter, defaultdict

import numpy as np
from tqdm import tqdm

from data.precompute import read_samples

IMAGE_EXTS = ("png", "jpg", "jpeg", "webp", "bmp", "gif", "tif", "tiff")
VIDEO_EXTS = ("mp4", "webm", "mkv", "avi", "mov")
MEDIA_EXTS = IMAGE_EXTS + VIDEO_EXTS + ("npy", "ply", "obj", "glb", "latent.npy")  # latent: --drop-media shards
TOP = 10  # rows in "top" tables and examples


def _size_from_meta(meta: dict) -> tuple[int, int] | None:
    if isinstance(meta.get("width"), (int, float)) and isinstance(meta.get("height"), (int, float)):
        return int(meta["width"]), int(meta["height"])
    for k in ("size", "original_size"):
        v = meta.get(k)
        if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v):
            return int(v[0]), int(v[1])
    return None


def scan_shard(args: tuple[str, bool]) -> dict:
    """Everything one shard contributes (runs in worker processes; never raises)."""
    path, verify = args
    from PIL import Image
    r = {"shard": path, "samples": 0, "members": defaultdict(lambda: [0, 0]), "sizes": [], "durations": [],
         "frames": [], "words": [], "chars": [], "no_caption": 0, "hashes": [], "corrupt": [], "shard_error": None,
         "size_source": Counter()}
    for key, sample in read_samples(path):
        if key is None:
            r["shard_error"] = f"{type(sample).__name__}: {sample}"
            break
        r["samples"] += 1
        for ext, data in sample.items():
            r["members"][ext][0] += 1
            r["members"][ext][1] += len(data)
        try:
            meta = {}
            if sample.get("json"):
                meta = json.loads(sample["json"])
                if not isinstance(meta, dict):
                    raise ValueError("json metadata is not an object")
            media_ext = next((e for e in MEDIA_EXTS if e in sample), None)
            if media_ext is None:
                raise ValueError("no media member")
            media = sample[media_ext]
            size = _size_from_meta(meta)
            if media_ext in IMAGE_EXTS and (size is None or verify):
                with Image.open(io.BytesIO(media)) as im:  # header only...
                    if verify:
                        im.load()  # ...unless asked to decode the pixels
                    if size is None:
                        size = im.size
                        r["size_source"]["header"] += 1
            elif size is not None:
                r["size_source"]["json"] += 1
            if size is not None:
                r["sizes"].append(size)
            if isinstance(meta.get("duration"), (int, float)):
                r["durations"].append(float(meta["duration"]))
            frames = meta.get("frames", meta.get("num_frames"))
            if isinstance(frames, (int, float)) and not isinstance(frames, bool):
                r["frames"].append(int(frames))
                if "duration" not in meta and isinstance(meta.get("fps"), (int, float)) and meta["fps"] > 0:
                    r["durations"].append(frames / meta["fps"])
            r["hashes"].append((hashlib.sha1(media).hexdigest(), key))
        except Exception as e:  # any failure to read the sample makes it corrupt, never fatal
            r["corrupt"].append({"shard": path, "key": key, "reason": f"{type(e).__name__}: {e}"})
            continue
        if sample.get("txt") is None:
            r["no_caption"] += 1
        else:
            cap = sample["txt"].decode("utf-8", errors="replace").strip()
            r["words"].append(len(cap.split()))
            r["chars"].append(len(cap))
    r["members"] = {k: v for k, v in r["members"].items()}
    return r


def histogram(values, bins: int = 20) -> dict:
    """{"count", "min", "max", "mean", "median", "edges", "counts"}; counts sum to count."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return {"count": 0}
    lo, hi = float(v.min()), float(v.max())
    if np.all(v == np.round(v)) and hi - lo + 1 <= bins:  # small integer ranges: one bin per value
        edges = np.arange(lo - 0.5, hi + 1.5)
    else:
        edges = np.linspace(lo, hi if hi > lo else lo + 1, bins + 1)
    counts, edges = np.histogram(v, bins=edges)
    return {"count": int(v.size), "min": lo, "max": hi, "mean": round(float(v.mean()), 4),
            "median": float(np.median(v)), "edges": [round(float(e), 4) for e in edges],
            "counts": [int(c) for c in counts]}


def collect(shards: list[str], workers: int = 1, verify: bool = False, progress: bool = True) -> dict:
    members: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    sizes, durations, frames, words, chars, corrupt, bad_shards = [], [], [], [], [], [], []
    by_hash: dict[str, list[str]] = defaultdict(list)
    samples = no_caption = 0
    size_source = Counter()
    jobs = [(s, verify) for s in shards]
    root = os.path.commonpath([os.path.dirname(os.path.abspath(s)) for s in shards]) if shards else ""
    pool = mp.Pool(workers) if workers > 1 and len(shards) > 1 else None
    try:
        results = pool.imap(scan_shard, jobs) if pool else map(scan_shard, jobs)
        for r in tqdm(results, total=len(jobs), unit="shard", disable=not progress):
            samples += r["samples"]
            for k, (n, b) in r["members"].items():
                members[k][0] += n
                members[k][1] += b
            sizes += r["sizes"]
            durations += r["durations"]
            frames += r["frames"]
            words += r["words"]
            chars += r["chars"]
            no_caption += r["no_caption"]
            corrupt += r["corrupt"]
            size_source.update(r["size_source"])
            for h, key in r["hashes"]:
                by_hash[h].append(f"{os.path.relpath(os.path.abspath(r['shard']), root)}:{key}")
            if r["shard_error"]:
                bad_shards.append({"shard": r["shard"], "reason": r["shard_error"], "samples_read": r["samples"]})
    finally:
        if pool:
            pool.terminate()
            pool.join()
    groups = sorted((v for v in by_hash.values() if len(v) > 1), key=lambda v: (-len(v), v))
    hashes = {tuple(v): h for h, v in by_hash.items() if len(v) > 1}
    res = Counter(f"{w}x{h}" for w, h in sizes)
    return {
        "shards": len(shards),
        "samples": samples,
        "bytes": sum(b for _, b in members.values()),
        "members": {k: {"count": n, "bytes": b} for k, (n, b) in sorted(members.items())},
        "resolution": {
            "count": len(sizes), "from": dict(size_source),
            "top": [[k, n] for k, n in res.most_common(TOP)],
            "width": histogram([w for w, _ in sizes]),
            "height": histogram([h for _, h in sizes]),
            "short_side": histogram([min(w, h) for w, h in sizes]),
        },
        "aspect_ratio": histogram([w / h for w, h in sizes if h > 0]),
        "duration": histogram(durations),
        "frames": histogram(frames),
        "caption": {"count": len(words), "missing": no_caption, "words": histogram(words), "chars": histogram(chars)},
        "duplicates": {
            "groups": len(groups),
            "samples_in_groups": sum(len(g) for g in groups),
            "redundant": sum(len(g) - 1 for g in groups),
            "top": [{"sha1": hashes[tuple(g)], "count": len(g), "keys": g[:TOP]} for g in groups[:TOP]],
        },
        "corrupt": {"count": len(corrupt), "examples": corrupt[:TOP], "shards": bad_shards},
    }


# --------------------------------------------------------------------------------------- output
PLOTS = [("short_side", "Shorter image side (px)", ("resolution", "short_side")),
         ("aspect_ratio", "Aspect ratio (w / h)", ("aspect_ratio",)),
         ("duration", "Duration (s)", ("duration",)),
         ("frames", "Frames", ("frames",)),
         ("caption_words", "Caption length (words)", ("caption", "words")),
         ("caption_chars", "Caption length (characters)", ("caption", "chars"))]


def _get(d: dict, path: tuple) -> dict:
    for p in path:
        d = d[p]
    return d


def plot(stats: dict, out: str) -> dict[str, str]:
    """One bar chart per non-empty histogram; returns {name: file name}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    files = {}
    for name, title, path in PLOTS:
        h = _get(stats, path)
        if not h.get("count"):
            continue
        e = np.asarray(h["edges"])
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.bar(e[:-1], h["counts"], width=np.diff(e), align="edge", edgecolor="black", linewidth=0.5)
        ax.set_title(title)
        ax.set_ylabel("samples")
        fig.tight_layout()
        files[name] = f"{name}.png"
        fig.savefig(os.path.join(out, files[name]), dpi=80)
        plt.close(fig)
    return files


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def markdown(stats: dict, plots: dict[str, str]) -> str:
    s = stats
    L = ["# Dataset statistics", "",
         "| | |", "|---|---|",
         f"| shards | {s['shards']} |", f"| samples | {s['samples']} |",
         f"| bytes | {s['bytes']} ({_fmt_bytes(s['bytes'])}) |",
         f"| corrupt samples | {s['corrupt']['count']} |", f"| unreadable shards | {len(s['corrupt']['shards'])} |",
         f"| duplicate groups | {s['duplicates']['groups']} ({s['duplicates']['redundant']} redundant samples) |",
         f"| captions | {s['caption']['count']} ({s['caption']['missing']} missing) |", "",
         "## Members", "", "| type | count | bytes | mean bytes |", "|---|---:|---:|---:|"]
    for k, m in s["members"].items():
        L.append(f"| `{k}` | {m['count']} | {m['bytes']} | {m['bytes'] / max(m['count'], 1):.0f} |")
    L += ["", "## Histograms", "", "| quantity | count | min | median | mean | max |", "|---|---:|---:|---:|---:|---:|"]
    for name, title, path in PLOTS:
        h = _get(s, path)
        if h.get("count"):
            L.append(f"| {title} | {h['count']} | {h['min']:g} | {h['median']:g} | {h['mean']:g} | {h['max']:g} |")
        else:
            L.append(f"| {title} | 0 | | | | |")
    L += ["", "### Most common resolutions", "", "| resolution | samples |", "|---|---:|"]
    L += [f"| {k} | {n} |" for k, n in s["resolution"]["top"]]
    for name, title, _ in PLOTS:
        if name in plots:
            L += ["", f"![{title}]({plots[name]})"]
    L += ["", "## Duplicates (sha1 of the media bytes)", "",
          f"{s['duplicates']['groups']} duplicate groups, {s['duplicates']['samples_in_groups']} samples in them.", ""]
    if s["duplicates"]["top"]:
        L += ["| sha1 | copies | samples |", "|---|---:|---|"]
        L += [f"| `{g['sha1'][:12]}` | {g['count']} | {', '.join(g['keys'])} |" for g in s["duplicates"]["top"]]
    L += ["", "## Corrupt", "", f"{s['corrupt']['count']} corrupt samples, "
          f"{len(s['corrupt']['shards'])} unreadable shards.", ""]
    if s["corrupt"]["examples"] or s["corrupt"]["shards"]:
        L += ["| shard | key | reason |", "|---|---|---|"]
        L += [f"| {os.path.basename(c['shard'])} | {c['key']} | {c['reason'].replace('|', '/')} |"
              for c in s["corrupt"]["examples"]]
        L += [f"| {os.path.basename(c['shard'])} | (after {c['samples_read']} samples) | "
              f"{c['reason'].replace('|', '/')} |" for c in s["corrupt"]["shards"]]
    return "\n".join(L) + "\n"


def write(stats: dict, out: str) -> dict[str, str]:
    os.makedirs(out, exist_ok=True)
    plots = plot(stats, out)
    stats = {**stats, "plots": plots}
    with open(os.path.join(out, "stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(markdown(stats, plots))
    return plots


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m data.stats",
        description="Statistics of WebDataset shards: counts and bytes per member type, histograms of "
        "resolution, aspect ratio, duration, frames and caption length, duplicate media (sha1) and "
        "corrupt samples. Writes OUT/stats.json, OUT/report.md and PNG plots.",
    )
    p.add_argument("shards", nargs="+", help="folder, brace pattern, glob or tar files")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--workers", type=int, default=1, help="processes, one shard at a time each (default 1)")
    p.add_argument("--verify", action="store_true", help="fully decode images (slower; finds truncated files)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    from common.data.shards import DataError, expand_shards
    a = _parser().parse_args(argv)
    if a.workers < 1:
        print(f"error: --workers must be >= 1, got {a.workers}", file=sys.stderr)
        return 2
    try:
        shards = expand_shards(a.shards)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stats = collect(shards, a.workers, a.verify, progress=not a.no_progress)
    write(stats, a.out)
    print(f"shards = {stats['shards']}, samples = {stats['samples']}, corrupt = {stats['corrupt']['count']}, "
          f"duplicate groups = {stats['duplicates']['groups']}; wrote {os.path.join(a.out, 'report.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
