"""Streaming, resumable, DP-exact micro-batch loader over WebDataset shards.

Contract: global micro-step m (counted from the loader's `samples_consumed`, `start`) covers
global positions [start + m*D*B, start + (m+1)*D*B) for D = dp_size, B = micro_batch_size; rank r
takes the r-th block of B. Hence a single process with B=D*b sees exactly what D ranks with b see,
concatenated rank-major, and the state is a single global position that stays meaningful when D or
B change on resume (the positions simply continue; a global batch may straddle an epoch boundary,
which is fine because positions, not epochs, define the stream).

Extension points (later issues): shape bucketing and multi-source mixing both belong in how a
micro-step's positions are chosen and grouped, i.e. in `_MicroSteps.positions` (e.g. a mixing
schedule mapping a global position to (source, position-in-source)), not in the workers' I/O code.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .order import GlobalOrder
from .shards import DataError, ShardIndex, expand_shards

log = logging.getLogger(__name__)

STATE_VERSION = 1

# Keys already reported as corrupt in this process: a bad sample is seen once per epoch and we
# do not want a log line every time.
_LOGGED_CORRUPT: set[str] = set()


def default_collate(samples: list[dict]) -> dict:
    """Stack tensors along a new batch dim; everything else (str, numbers, ...) becomes a list."""
    keys = samples[0].keys()
    for s in samples[1:]:
        if s.keys() != keys:
            raise DataError(f"decoded samples have different fields: {sorted(keys)} vs {sorted(s.keys())}")
    out = {}
    for k in keys:
        vals = [s[k] for s in samples]
        out[k] = torch.stack(vals) if isinstance(vals[0], torch.Tensor) else vals
    return out


def _identity(x):
    return x


class _MicroSteps(IterableDataset):
    """Worker w of W produces micro-steps m = w, w+W, w+2W, ... in order.

    torch's DataLoader polls workers round-robin and returns results in task order, so the
    main process receives m = 0, 1, 2, ... exactly, whatever the number of workers.
    """

    def __init__(self, index: ShardIndex, order: GlobalOrder, decode: Callable[[dict], dict],
                 collate: Callable[[list[dict]], dict], batch_size: int, dp_rank: int,
                 dp_size: int, start: int):
        self.index, self.order, self.decode, self.collate = index, order, decode, collate
        self.B, self.dp_rank, self.dp_size, self.start = batch_size, dp_rank, dp_size, start

    def positions(self, m: int) -> list[int]:
        first = self.start + (m * self.dp_size + self.dp_rank) * self.B
        return list(range(first, first + self.B))

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        m = wid
        while True:
            yield self.micro_batch(m)
            m += nw

    def micro_batch(self, m: int) -> dict:
        positions = self.positions(m)
        decoded: list[dict | None] = []
        keys: list[str] = []
        for p in positions:
            shard_id, sample_id, _ = self.order.locate(p)
            raw = self.index.read(shard_id, sample_id)  # I/O errors are not sample corruption: raise
            keys.append(raw["__key__"])
            try:
                out = self.decode(raw)
                if not isinstance(out, dict):
                    raise TypeError(f"decode returned {type(out).__name__}, expected dict")
                decoded.append(out)
            except Exception as e:  # any failure to decode = corrupt sample
                decoded.append(None)
                tag = f"{raw['__url__']}:{raw['__key__']}"
                if tag not in _LOGGED_CORRUPT:
                    _LOGGED_CORRUPT.add(tag)
                    log.warning("skipping corrupt sample %s (position %d): %s: %s",
                                tag, p, type(e).__name__, e)
        bad = [i for i, d in enumerate(decoded) if d is None]
        if len(bad) == self.B:
            raise DataError(f"all {self.B} samples of a micro-batch failed to decode: {keys}")
        # Fill each corrupt slot with the next valid sample cyclically: deterministic, keeps every
        # rank at exactly B samples, and the slot reports the position of the sample actually used.
        used = list(range(self.B))
        for i in bad:
            j = (i + 1) % self.B
            while decoded[j] is None:
                j = (j + 1) % self.B
            used[i] = j
        batch = self.collate([decoded[j] for j in used])
        batch["__position__"] = torch.tensor([positions[j] for j in used], dtype=torch.long)
        batch["__key__"] = [keys[j] for j in used]
        batch["__corrupt__"] = len(bad)
        return batch


class StreamingLoader:
    """Infinite iterator of micro-batches for one data-parallel rank (see module docstring).

    `decode(sample) -> dict` is supplied by the pipeline: `sample` is `{__key__, __url__,
    ext: bytes}`; an exception in it marks the sample corrupt (skipped, counted, logged once per
    key, its slot filled by another sample of the same micro-batch). Each batch is
    `collate(decoded samples)` plus `__position__` (LongTensor[B] of global positions),
    `__key__` (list[str]) and `__corrupt__` (int).

    `iter()` always starts at `samples_consumed`: after `load_state_dict` that is the loaded
    position, otherwise it continues where the previous iterator stopped (batches prefetched by
    workers but never handed out are not counted, so they are produced again).
    """

    def __init__(self, shards, decode: Callable[[dict], dict], micro_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, num_workers: int = 2, seed: int = 0,
                 shuffle: bool = True, window: int = 8,
                 collate: Callable[[list[dict]], dict] | None = None, prefetch_factor: int = 2):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank} dp_size={dp_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.index = shards if isinstance(shards, ShardIndex) else ShardIndex(expand_shards(shards))
        self.order = GlobalOrder(self.index.shard_sizes, seed=seed, shuffle=shuffle, window=window)
        self.decode, self.collate = decode, collate or default_collate
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.seed = int(seed)
        self.samples_consumed = 0   # global positions fully consumed (all ranks together)
        self.corrupt_total = 0      # corrupt samples in batches handed out by this loader
        # Weak: a strong reference would make a cycle (the stream's frame holds self), and a
        # DataLoader iterator torn down by the cycle collector waits ~5 s per worker to join.
        self._active: weakref.ref | None = None

    @property
    def num_samples(self) -> int:
        return self.index.num_samples

    @property
    def epoch(self) -> int:
        """Epoch of the next position to be read."""
        return self.samples_consumed // self.num_samples

    @property
    def global_batch_per_step(self) -> int:
        return self.micro_batch_size * self.dp_size

    def state_dict(self) -> dict:
        return {"samples_consumed": self.samples_consumed, "num_samples": self.num_samples,
                "seed": self.seed, "version": STATE_VERSION}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("version") != STATE_VERSION:
            raise DataError(f"data-loader state version {sd.get('version')!r} is not supported "
                            f"(expected {STATE_VERSION})")
        if int(sd["num_samples"]) != self.num_samples:
            raise DataError(f"dataset changed: the checkpoint's loader saw {sd['num_samples']} "
                            f"samples, the current shards hold {self.num_samples}; an exact "
                            f"resume needs the same shards")
        if int(sd["seed"]) != self.seed:
            # A different seed means a different order: the resumed run would repeat and skip samples.
            raise DataError(f"data seed changed: checkpoint has seed={sd['seed']}, loader has "
                            f"seed={self.seed}")
        self._close_active()
        self.samples_consumed = int(sd["samples_consumed"])

    def _close_active(self) -> None:
        stream = self._active() if self._active is not None else None
        if stream is not None:
            stream.close()  # shuts its worker processes down
        self._active = None

    def __iter__(self) -> Iterator[dict]:
        self._close_active()  # only one live stream, otherwise the consumed count is ambiguous
        stream = self._stream()
        self._active = weakref.ref(stream)
        return stream

    def _stream(self) -> Iterator[dict]:
        ds = _MicroSteps(self.index, self.order, self.decode, self.collate, self.micro_batch_size,
                         self.dp_rank, self.dp_size, self.samples_consumed)
        if self.num_workers == 0:
            source = iter(ds)
        else:
            dl = DataLoader(ds, batch_size=None, collate_fn=_identity, num_workers=self.num_workers,
                            prefetch_factor=self.prefetch_factor, persistent_workers=False)
            source = iter(dl)
        try:
            for batch in source:
                # Counted when handed out, so a checkpoint taken after training on this batch
                # resumes right after it.
                self.samples_consumed += self.global_batch_per_step
                self.corrupt_total += batch["__corrupt__"]
                yield batch
        finally:
            del source  # last reference: the DataLoader iterator shuts its workers down now
