"""Convert raw media plus captions into WebDataset shards.

    python -m data.make_shards images --input PATH --out DIR [--size 256] [--crop center]

One subcommand per media kind (`images` today; video and mesh sources plug in as further
subcommands reusing `convert`). Every input is accounted for: it is either written or skipped
with a reason in the report (JSONL), and the last line reads `read = N, written = W, skipped = S`
with read == written + skipped.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import multiprocessing as mp
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import webdataset as wds
from PIL import Image, ImageOps
from tqdm import tqdm

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
PATH_COLUMNS = ("path", "file_name", "image")
CAPTION_COLUMNS = ("caption", "text")


class InputError(Exception):
    """The input as a whole is unusable (missing path, manifest without the needed columns)."""


@dataclass
class Item:
    """One input before decoding. `error` set means it is already known to be bad."""

    index: int
    source: str  # path, or "manifest:line" when there is no usable path
    caption: str | None = None
    data: bytes | None = None  # inline image bytes (parquet manifests of HF datasets)
    error: str | None = None
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------- inputs
def _clean_caption(v) -> str | None:
    if v is None or (isinstance(v, float) and v != v):  # None / NaN from pandas-style files
        return None
    v = str(v).strip()
    return v or None


def _folder_items(root: str) -> Iterator[Item]:
    """Images with same-stem .txt sidecars; orphan .txt files are inputs too (reported)."""
    files = []
    for dirpath, dirnames, names in os.walk(root):
        dirnames.sort()
        files.extend(os.path.join(dirpath, n) for n in sorted(names))
    images = [f for f in files if f.lower().endswith(IMAGE_EXTS)]
    stems = {os.path.splitext(f)[0] for f in images}
    orphans = [f for f in files if f.endswith(".txt") and os.path.splitext(f)[0] not in stems]
    for i, f in enumerate(images):
        txt = os.path.splitext(f)[0] + ".txt"
        cap = None
        if os.path.isfile(txt):
            with open(txt, encoding="utf-8", errors="replace") as fh:
                cap = _clean_caption(fh.read())
        yield Item(i, f, cap, error=None if cap else "missing caption")
    for j, f in enumerate(orphans):
        yield Item(len(images) + j, f, error="caption without image")


def _row_item(index: int, row: dict, base: str, where: str) -> Item:
    path_key = next((k for k in PATH_COLUMNS if row.get(k) not in (None, "")), None)
    cap_key = next((k for k in CAPTION_COLUMNS if k in row), None)
    cap = _clean_caption(row.get(cap_key)) if cap_key else None
    if path_key is None:
        return Item(index, where, cap, error="malformed manifest row: no image path")
    value = row[path_key]
    data = None
    if isinstance(value, dict):  # Hugging Face `Image` feature: {"bytes": ..., "path": ...}
        data, value = value.get("bytes"), value.get("path") or where
    source = os.path.join(base, str(value)) if data is None else str(value)
    if cap is None:
        return Item(index, source, error="missing caption")
    return Item(index, source, cap, data=data)


def _jsonl_items(path: str) -> Iterator[Item]:
    base = os.path.dirname(path)
    with open(path, encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f):
            where = f"{path}:{i + 1}"
            if not line.strip():
                continue  # blank lines are formatting, not inputs
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError("not an object")
            except ValueError as e:
                yield Item(i, where, error=f"malformed manifest row: {e}")
                continue
            yield _row_item(i, row, base, where)


def _table_items(path: str) -> Iterator[Item]:
    base = os.path.dirname(path)
    if path.lower().endswith(".parquet"):
        import pyarrow.parquet as pq  # only parquet inputs pay the import

        rows = pq.read_table(path).to_pylist()
        header = rows[0].keys() if rows else pq.read_schema(path).names
    else:
        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            rows = list(reader)
    # A manifest without the columns is a usage error, not N bad rows.
    if not any(c in header for c in PATH_COLUMNS) or not any(c in header for c in CAPTION_COLUMNS):
        raise InputError(
            f"manifest {path} needs a path column ({'/'.join(PATH_COLUMNS)}) and a caption "
            f"column ({'/'.join(CAPTION_COLUMNS)}); it has {list(header)}"
        )
    for i, row in enumerate(rows):
        if None in row:  # csv.DictReader puts surplus fields under the key None
            yield Item(i, f"{path}:{i + 2}", error="malformed manifest row: too many fields")
            continue
        yield _row_item(i, row, base, f"{path}:{i + 2}")


def image_items(path: str) -> Iterator[Item]:
    """Pick the input form: metadata.jsonl folder, sidecar folder, or .csv/.parquet/.jsonl file."""
    if not os.path.exists(path):
        raise InputError(f"input path {path} does not exist")
    if os.path.isdir(path):
        meta = os.path.join(path, "metadata.jsonl")
        return _jsonl_items(meta) if os.path.isfile(meta) else _folder_items(path)
    low = path.lower()
    if low.endswith((".csv", ".parquet")):
        return _table_items(path)
    if low.endswith(".jsonl"):
        return _jsonl_items(path)
    raise InputError(f"input {path} is neither a folder nor a .csv/.parquet/.jsonl manifest")


# ------------------------------------------------------------------------------- image transform
@dataclass(frozen=True)
class ImageOpts:
    size: int = 256
    crop: str = "center"
    fmt: str = "jpg"
    quality: int = 95
    min_size: int = 0


def _transform(im: Image.Image, opts: ImageOpts) -> Image.Image | None:
    """Shorter side to opts.size, then optional centre crop; None when below opts.min_size."""
    w, h = im.size
    if min(w, h) < opts.min_size:
        return None
    if opts.size > 0:
        s = opts.size / min(w, h)
        nw, nh = max(opts.size, round(w * s)), max(opts.size, round(h * s))
        if (nw, nh) != (w, h):
            # reducing_gap: a cheap integer pre-shrink before the LANCZOS pass, same quality.
            im = im.resize((nw, nh), Image.LANCZOS, reducing_gap=3.0)
        if opts.crop == "center":
            left, top = (nw - opts.size) // 2, (nh - opts.size) // 2
            im = im.crop((left, top, left + opts.size, top + opts.size))
    return im


def process_image(item: Item, opts: ImageOpts) -> tuple[Item, dict | None]:
    """Decode, resize, crop, re-encode one item; returns (item, sample) or (item with error, None).

    Runs in worker processes: everything it needs travels in its arguments, and it never raises.
    """
    if item.error:
        return item, None
    try:
        if item.data is None and not os.path.isfile(item.source):
            item.error = "missing file"
            return item, None
        src = io.BytesIO(item.data) if item.data is not None else item.source
        with Image.open(src) as im:
            im.load()  # force the full decode here: truncated files fail now, not in training
            im = ImageOps.exif_transpose(im)  # phone photos store rotation in EXIF only
            orig = im.size
            im = im.convert("RGB")  # palettes, alpha, CMYK, 16-bit: one layout for training
    except Exception as e:  # PIL raises many types for bad data; all mean "unreadable"
        item.error = f"unreadable image: {type(e).__name__}: {e}"
        return item, None
    try:
        im = _transform(im, opts)
        if im is None:
            item.error = f"too small: {orig[0]}x{orig[1]} < --min-size {opts.min_size}"
            return item, None
        buf = io.BytesIO()
        if opts.fmt == "png":
            im.save(buf, format="PNG", compress_level=6)
        else:  # 4:4:4 chroma at high quality: thin coloured edges survive re-encoding
            im.save(buf, format="JPEG", quality=opts.quality, subsampling=0 if opts.quality >= 90 else 2)
    except Exception as e:  # e.g. MemoryError on a giant image: skip it, keep the run alive
        item.error = f"transform failed: {type(e).__name__}: {e}"
        return item, None
    w, h = orig
    meta = {"source": item.source, "original_size": [w, h], "size": list(im.size), **item.extra}
    sample = {
        "__key__": f"{item.index:09d}",
        opts.fmt: buf.getvalue(),
        "txt": item.caption,
        "json": json.dumps(meta, sort_keys=True),
    }
    return item, sample


# ----------------------------------------------------------------------------------- conversion
def convert(
    items: Iterator[Item],
    work: Callable[[Item], tuple[Item, dict | None]],
    out: str,
    shard_size: int = 1000,
    workers: int = 1,
    report: str | None = None,
    progress: bool = True,
) -> dict:
    """Run `work` over `items` (in a pool when workers > 1, order kept) and write shards to `out`.

    Media-agnostic: a video or mesh subcommand only supplies its own items and `work`.
    Returns {"read", "written", "skipped", "shards", "report"}.
    """
    os.makedirs(out, exist_ok=True)
    report = report or os.path.join(out, "report.jsonl")
    # Shards of an earlier, larger run would silently join this dataset (loaders read every *.tar
    # in the folder); only files with our exact naming are removed.
    stale = [f for f in os.listdir(out) if re.fullmatch(r"shard-\d{6}\.tar", f)]
    for f in stale:
        os.remove(os.path.join(out, f))
    if stale:
        print(f"note: removed {len(stale)} shard(s) of an earlier run in {out}", file=sys.stderr)
    items = list(items)  # known total for the progress bar; manifests hold paths, not pixels
    read = written = skipped = 0
    writer = None  # opened on the first good sample so an all-bad run leaves no empty shard
    pool = mp.Pool(workers) if workers > 1 and len(items) > 1 else None
    try:
        results = pool.imap(work, items, chunksize=8) if pool else map(work, items)
        with open(report, "w") as rep:
            for item, sample in tqdm(results, total=len(items), unit="img", disable=not progress):
                read += 1
                if sample is None:
                    skipped += 1
                    rep.write(json.dumps({"index": item.index, "source": item.source, "reason": item.error}) + "\n")
                    continue
                if writer is None:
                    writer = wds.ShardWriter(os.path.join(out, "shard-%06d.tar"), maxcount=shard_size,
                                             verbose=0, mtime=0.0)  # fmt: skip
                writer.write(sample)
                written += 1
    finally:
        if pool:  # terminate, not close: on Ctrl-C or an error the queued work is not wanted
            pool.terminate()
            pool.join()
        if writer is not None:
            writer.close()
    shards = (written + shard_size - 1) // shard_size
    return {"read": read, "written": written, "skipped": skipped, "shards": shards, "report": report}


class _ImageWork:
    """Picklable callable binding the options, for Pool.imap."""

    def __init__(self, opts: ImageOpts):
        self.opts = opts

    def __call__(self, item: Item):
        return process_image(item, self.opts)


def images_main(a: argparse.Namespace) -> dict:
    opts = ImageOpts(size=a.size, crop=a.crop, fmt=a.format, quality=a.quality, min_size=a.min_size)
    return convert(image_items(a.input), _ImageWork(opts), a.out, a.shard_size, a.workers,
                   a.report, progress=not a.no_progress)  # fmt: skip


# ------------------------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m data.make_shards",
        description="Convert raw media + captions into WebDataset shards (shard-%06d.tar). "
        "Bad inputs are skipped and listed with their reason in a JSONL report.",
    )
    sub = p.add_subparsers(dest="kind", required=True, metavar="{images}")
    im = sub.add_parser(
        "images",
        help="images with captions",
        description="Input forms: (a) a folder of images with same-stem .txt captions; (b) a folder "
        "holding metadata.jsonl with file_name and text (Hugging Face ImageFolder); (c) a .csv, "
        ".parquet or .jsonl manifest with a path column (path/file_name/image) and a caption "
        "column (caption/text), paths relative to the manifest's folder. Each sample gets "
        "__key__, jpg (or png), txt and json (source, original_size, size).",
    )
    im.add_argument("--input", required=True, help="folder or manifest file (see above)")
    im.add_argument("--out", required=True, help="output folder for shard-%%06d.tar and the report")
    im.add_argument("--size", type=int, default=256,
                    help="resize so the shorter side is SIZE px (upscales small images; 0 keeps the "
                    "original size) (default 256)")  # fmt: skip
    im.add_argument("--crop", choices=("center", "none"), default="center",
                    help="center: centre-crop to SIZE x SIZE; none: keep the aspect ratio (default center)")
    im.add_argument("--format", choices=("jpg", "png"), default="jpg",
                    help="re-encoding: jpg (quality --quality, 4:4:4 chroma) or lossless png (default jpg)")
    im.add_argument("--quality", type=int, default=95, help="JPEG quality (default 95)")
    im.add_argument("--min-size", type=int, default=0,
                    help="skip images whose shorter side is below this many px (default 0: keep all)")
    im.add_argument("--shard-size", type=int, default=1000, help="samples per shard (default 1000)")
    im.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1) - 1),
                    help="decode/resize processes; 1 runs in-process (default: CPUs - 1)")
    im.add_argument("--report", default=None, help="JSONL of skipped inputs (default OUT/report.jsonl)")
    im.add_argument("--no-progress", action="store_true", help="no progress bar")
    im.set_defaults(run=images_main)
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    for name in ("size", "shard_size", "workers", "quality"):
        v = getattr(a, name, None)
        if v is not None and v < (0 if name == "size" else 1):
            print(f"error: --{name.replace('_', '-')} must be positive, got {v}", file=sys.stderr)
            return 2
    try:
        r = a.run(a)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"read = {r['read']}, written = {r['written']}, skipped = {r['skipped']}")
    if r["read"] == 0:
        print(f"error: no inputs found in {a.input}", file=sys.stderr)
        return 1
    if r["written"] == 0:
        print(f"error: all {r['read']} inputs failed; reasons in {r['report']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
