"""What the image (`data/synth.py`), video (`data/synth_video.py`) and VQA (`data/synth_vqa.py`)
modes of the synthetic shapes dataset share: splits and their seed codes, the size jitter, caption
grammar, the reproducible PNG encoder and shard writer, and the manifest that marks a complete
dataset.

A module of its own so that no mode imports another (only the `data.synth` CLI dispatches to the
video and VQA modes).
"""

from __future__ import annotations

import glob
import io
import json
import os
import time
from collections.abc import Callable

import numpy as np
import webdataset as wds
from PIL import Image
from tqdm import tqdm

SPLITS = ("train", "heldout")
SPLIT_CODE = {"train": 0, "heldout": 1}  # part of every sample's seed: splits draw apart
MANIFEST = "manifest.json"
RADIUS_JITTER = 0.08  # relative; small enough that size names never overlap


def article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def encode_png(img: np.ndarray) -> bytes:
    buf = io.BytesIO()
    # Fixed compress level and no optimize pass: the bytes depend on the pixels only.
    Image.fromarray(img).save(buf, format="PNG", compress_level=6, optimize=False)
    return buf.getvalue()


def write_split(out: str, split: str, count: int, shard_size: int, make: Callable[[str, int], dict],
                progress: bool = False) -> list[str]:  # fmt: skip
    """Write `count` samples of `split` as shards; `make(split, i)` builds sample i."""
    split_dir = os.path.join(out, split)
    os.makedirs(split_dir, exist_ok=True)
    # Stale shards from an earlier, larger run would silently join this dataset (the loader reads
    # every *.tar in the folder), so remove the files this generator owns before writing.
    for old in glob.glob(os.path.join(glob.escape(split_dir), "shard-*.tar")):
        os.remove(old)
    if count == 0:
        return []
    pattern = os.path.join(split_dir, "shard-%06d.tar")
    # mtime=0 and fixed owner make the tar headers reproducible; verbose=0 keeps stdout clean.
    writer = wds.ShardWriter(pattern, maxcount=shard_size, verbose=0, mtime=0.0)
    try:
        for i in tqdm(range(count), desc=split, unit="sample", disable=not progress, leave=False):
            writer.write(make(split, i))
    finally:
        writer.close()
    n_shards = (count + shard_size - 1) // shard_size
    return [os.path.join(split, f"shard-{k:06d}.tar") for k in range(n_shards)]


def load_manifest(out: str) -> dict | None:
    """The manifest of a complete dataset in `out`, or None when absent or unreadable."""
    try:
        with open(os.path.join(out, MANIFEST)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_manifest(out: str, manifest: dict) -> None:
    """Write out/manifest.json atomically. Call it last: its presence marks a complete dataset, and
    it carries no timestamps, so it is part of the reproducible output."""
    path = os.path.join(out, MANIFEST)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def check_at_least(*checks: tuple[str, object, int]) -> None:
    """ValueError for the first (name, value, lowest) whose value is not an integer >= lowest."""
    for name, v, lo in checks:
        if int(v) != v or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")


def write_dataset(out: str, count: int, heldout_count: int, shard_size: int, make: Callable[[str, int], dict],
                  manifest: dict, progress: bool = False) -> dict:
    """The generation every mode shares: both splits through write_split, then the manifest (with
    the split counts and shard paths added) as the completion marker. Returns the summary
    {"out", **manifest, "seconds"}."""
    out = os.fspath(out)
    os.makedirs(out, exist_ok=True)
    manifest_path = os.path.join(out, MANIFEST)
    if os.path.exists(manifest_path):
        os.remove(manifest_path)  # absent until the new dataset is complete
    t0 = time.perf_counter()
    counts = {"train": int(count), "heldout": int(heldout_count)}
    shards = {sp: write_split(out, sp, counts[sp], shard_size, make, progress) for sp in SPLITS}
    manifest = {**manifest, "counts": counts, "shards": shards}
    write_manifest(out, manifest)
    return {"out": out, **manifest, "seconds": round(time.perf_counter() - t0, 3)}


def reuse_or_generate(out: str, defaults: dict, kwargs: dict, generate: Callable[..., dict], *,
                      format_version: int, mode: str | None = None,
                      normalise: Callable[[dict], dict] = lambda args: args) -> dict:
    """Generate into `out` unless a complete dataset of this mode, format and arguments (defaults
    updated by kwargs, then normalised as the manifest records them) is already there."""
    kwargs = dict(kwargs)
    progress = kwargs.pop("progress", False)
    unknown = set(kwargs) - set(defaults)
    if unknown:
        raise TypeError(f"unknown arguments {sorted(unknown)}; known: {sorted(defaults)}")
    args = normalise({**defaults, **kwargs})
    found = load_manifest(out)
    if (found is not None and found.get("mode") == mode and found.get("args") == args
            and found.get("format_version") == format_version):  # fmt: skip
        return {"out": os.fspath(out), **found, "seconds": 0.0}
    return generate(out, progress=progress, **args)
