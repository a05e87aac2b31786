"""Shard discovery and random access into WebDataset tar shards.

The loader addresses samples by (shard, sample) instead of streaming tars front to back: that is
what lets every data-parallel rank compute the same global order and read only its own slice, and
what makes a resume land on an exact sample. The price is a small per-shard index (member ->
offset/size), built by scanning tar headers only; payload bytes are never read while indexing.
"""

from __future__ import annotations

import glob
import os
import tarfile
from collections.abc import Iterable, Sequence

import braceexpand


class DataError(ValueError):
    """A data problem the user must fix (bad path, empty or malformed dataset, stale state)."""


def expand_shards(spec: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
    """Turn a shard spec into a list of tar paths.

    `spec` is a directory (every `*.tar` inside, sorted), a brace pattern
    (`/d/shard-{000000..000009}.tar`), a glob (`/d/*.tar`), a plain file, or a list of those
    (concatenated in the given order, duplicates kept: listing a shard twice up-weights it).
    """
    if isinstance(spec, (str, os.PathLike)):
        specs = [os.fspath(spec)]
    else:
        specs = [os.fspath(s) for s in spec]
    if not specs:
        raise DataError("no shards given: the shard spec is an empty list")
    paths: list[str] = []
    for s in specs:
        paths.extend(_expand_one(s))
    return paths


def _expand_one(spec: str) -> list[str]:
    if os.path.isdir(spec):
        found = sorted(glob.glob(os.path.join(glob.escape(spec), "*.tar")))
        if not found:
            raise DataError(f"shard directory {spec!r} contains no .tar files")
        return found
    if os.path.isfile(spec):
        return [spec]
    is_pattern = any(c in spec for c in "{*?[")
    if not is_pattern:
        raise DataError(f"shard path {spec!r} does not exist")
    out: list[str] = []
    missing: list[str] = []
    expanded = list(braceexpand.braceexpand(spec))
    for pat in expanded:
        if any(c in pat for c in "*?["):
            out.extend(sorted(glob.glob(pat)))
        elif os.path.isfile(pat):
            out.append(pat)
        else:
            missing.append(pat)
    if not out:
        raise DataError(f"shard pattern {spec!r} matches no files")
    if missing:
        # A brace range names shards explicitly: a hole in it is a real problem, not a filter.
        raise DataError(f"shard pattern {spec!r}: {len(missing)} of {len(expanded)} shards "
                        f"do not exist, e.g. {missing[0]!r}")
    return out


def split_member_name(name: str) -> tuple[str, str] | None:
    """WebDataset grouping rule: `dir/key.ext.more` -> (`dir/key`, `ext.more`); no dot -> None."""
    head, _, base = name.rpartition("/")
    if "." not in base or base.startswith("."):
        return None
    stem, ext = base.split(".", 1)
    return (f"{head}/{stem}" if head else stem), ext.lower()


# One sample: (key, {ext: (offset, size)}). Tuples keep the index small for large shards.
Sample = tuple[str, dict[str, tuple[int, int]]]

# Per-process cache: DataLoader workers fork after the index is built, so they inherit it; a
# second loader over the same files (eval, resume in-process) does not rescan.
_INDEX_CACHE: dict[tuple[str, int, int], list[Sample]] = {}


def index_shard(path: str) -> list[Sample]:
    """Scan one tar's headers and group members into samples (cached per process)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise DataError(f"cannot read shard {path!r}: {e.strerror}") from None
    cache_key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    cached = _INDEX_CACHE.get(cache_key)
    if cached is not None:
        return cached
    samples: list[Sample] = []
    # A malformed shard is fatal rather than skipped: silently dropping it would change the
    # dataset size, and with it the global order, between a run and its resume.
    try:
        with tarfile.open(path, mode="r:") as tf:
            for ti in tf:
                if not ti.isreg():
                    continue
                if "/" not in ti.name and ti.name.startswith("__") and ti.name.endswith("__"):
                    continue  # WebDataset per-shard metadata, not a sample member
                parts = split_member_name(ti.name)
                if parts is None:
                    continue  # WebDataset ignores members without an extension too
                key, ext = parts
                if not samples or samples[-1][0] != key:
                    samples.append((key, {}))
                members = samples[-1][1]
                if ext in members:
                    raise DataError(f"shard {path!r}: duplicate member {ti.name!r} in sample {key!r}")
                members[ext] = (ti.offset_data, ti.size)
            tf.members.clear()  # tarfile keeps every TarInfo; we have what we need
    except (tarfile.TarError, EOFError) as e:
        raise DataError(f"shard {path!r} is not a valid tar file ({e})") from None
    _INDEX_CACHE[cache_key] = samples
    return samples


class ShardIndex:
    """Random access to the samples of a list of tar shards.

    `read(shard_id, sample_id)` returns the WebDataset-style dict `{__key__, __url__, ext: bytes}`.
    File descriptors are opened lazily per process (reads use `os.pread`, so a descriptor inherited
    through fork would be safe too, but a fresh one per pid keeps ownership simple).
    """

    def __init__(self, paths: Sequence[str]):
        if isinstance(paths, (str, os.PathLike)):
            paths = [os.fspath(paths)]
        self.paths = [os.fspath(p) for p in paths]
        if not self.paths:
            raise DataError("no shards given")
        self._samples = [index_shard(p) for p in self.paths]
        self.shard_sizes = [len(s) for s in self._samples]
        self.num_samples = sum(self.shard_sizes)
        if self.num_samples == 0:
            raise DataError(f"dataset is empty: 0 samples in {len(self.paths)} shard(s), "
                            f"e.g. {self.paths[0]!r}")
        self._fds: dict[int, int] = {}
        self._fd_pid = os.getpid()

    def __len__(self) -> int:
        return self.num_samples

    def key(self, shard_id: int, sample_id: int) -> str:
        return self._samples[shard_id][sample_id][0]

    def _fd(self, shard_id: int) -> int:
        if self._fd_pid != os.getpid():  # forked: never share descriptors with the parent
            self._fds, self._fd_pid = {}, os.getpid()
        fd = self._fds.get(shard_id)
        if fd is None:
            fd = self._fds[shard_id] = os.open(self.paths[shard_id], os.O_RDONLY)
        return fd

    def read(self, shard_id: int, sample_id: int) -> dict:
        key, members = self._samples[shard_id][sample_id]
        url = self.paths[shard_id]
        # Members of one sample are adjacent in the tar: one pread covers them all.
        lo = min(off for off, _ in members.values())
        hi = max(off + size for off, size in members.values())
        buf = os.pread(self._fd(shard_id), hi - lo, lo)
        if len(buf) != hi - lo:
            raise DataError(f"shard {url!r} is shorter than its index (changed since indexing?)")
        out: dict = {"__key__": key, "__url__": url}
        for ext, (off, size) in members.items():
            out[ext] = buf[off - lo: off - lo + size]
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def __getstate__(self):
        # Descriptors do not survive pickling (spawn-started workers reopen lazily).
        state = self.__dict__.copy()
        state["_fds"] = {}
        return state

    def __del__(self):
        try:
            if self._fd_pid == os.getpid():
                self.close()
        except Exception:
            pass


def iter_samples(spec):
    """Every sample of some shards ({__key__, __url__, ext: bytes}) in shard order, no shuffle;
    reads only what the caller consumes."""
    index = ShardIndex(expand_shards(spec))
    try:
        for shard_id, size in enumerate(index.shard_sizes):
            for sample_id in range(size):
                yield index.read(shard_id, sample_id)
    finally:
        index.close()
