"""Input records and the folder / manifest readers shared by every media kind."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

PATH_COLUMNS = ("path", "file_name", "image")
CAPTION_COLUMNS = ("caption", "text")
EXTRA_COLUMNS = ("start", "end")  # optional per-row clip bounds (seconds), used by videos


class InputError(Exception):
    """The input as a whole is unusable (missing path, manifest without the needed columns)."""


@dataclass
class Item:
    """One input before decoding. `error` set means it is already known to be bad."""

    index: int
    source: str  # path, or "manifest:line" when there is no usable path
    caption: str | None = None
    data: bytes | None = None  # inline bytes (parquet manifests of HF datasets)
    error: str | None = None
    extra: dict = field(default_factory=dict)


def clean_caption(v) -> str | None:
    if v is None or (isinstance(v, float) and v != v):  # None / NaN from pandas-style files
        return None
    v = str(v).strip()
    return v or None


def read_text(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as fh:
        return clean_caption(fh.read())


def folder_items(root: str, exts: tuple[str, ...], noun: str = "image") -> Iterator[Item]:
    """Media files with same-stem .txt sidecars; orphan .txt files are inputs too (reported)."""
    files = []
    for dirpath, dirnames, names in os.walk(root):
        dirnames.sort()
        files.extend(os.path.join(dirpath, n) for n in sorted(names))
    media = [f for f in files if f.lower().endswith(exts)]
    stems = {os.path.splitext(f)[0] for f in media}
    orphans = [f for f in files if f.endswith(".txt") and os.path.splitext(f)[0] not in stems]
    for i, f in enumerate(media):
        cap = read_text(os.path.splitext(f)[0] + ".txt")
        yield Item(i, f, cap, error=None if cap else "missing caption")
    for j, f in enumerate(orphans):
        yield Item(len(media) + j, f, error=f"caption without {noun}")


def _row_item(index: int, row: dict, base: str, where: str, noun: str) -> Item:
    path_key = next((k for k in PATH_COLUMNS if row.get(k) not in (None, "")), None)
    cap_key = next((k for k in CAPTION_COLUMNS if k in row), None)
    cap = clean_caption(row.get(cap_key)) if cap_key else None
    if path_key is None:
        return Item(index, where, cap, error=f"malformed manifest row: no {noun} path")
    value = row[path_key]
    data = None
    if isinstance(value, dict):  # Hugging Face `Image` feature: {"bytes": ..., "path": ...}
        data, value = value.get("bytes"), value.get("path") or where
    source = os.path.join(base, str(value)) if data is None else str(value)
    if cap is None:
        return Item(index, source, error="missing caption")
    extra = {k: row[k] for k in EXTRA_COLUMNS if row.get(k) not in (None, "")}
    return Item(index, source, cap, data=data, extra=extra)


def jsonl_items(path: str, noun: str = "image") -> Iterator[Item]:
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
            yield _row_item(i, row, base, where, noun)


def table_items(path: str, noun: str = "image") -> Iterator[Item]:
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
        yield _row_item(i, row, base, f"{path}:{i + 2}", noun)


def media_items(path: str, exts: tuple[str, ...], noun: str = "image") -> Iterator[Item]:
    """Pick the input form: metadata.jsonl folder, sidecar folder, or .csv/.parquet/.jsonl file."""
    if not os.path.exists(path):
        raise InputError(f"input path {path} does not exist")
    if os.path.isdir(path):
        meta = os.path.join(path, "metadata.jsonl")
        return jsonl_items(meta, noun) if os.path.isfile(meta) else folder_items(path, exts, noun)
    low = path.lower()
    if low.endswith((".csv", ".parquet")):
        return table_items(path, noun)
    if low.endswith(".jsonl"):
        return jsonl_items(path, noun)
    raise InputError(f"input {path} is neither a folder nor a .csv/.parquet/.jsonl manifest")
