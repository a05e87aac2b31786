"""Streaming, resumable, DP-exact micro-batch loader over WebDataset shards.

Contract: global micro-step m (counted from the loader's `samples_consumed`, `start`) covers
global positions [start + m*D*B, start + (m+1)*D*B) for D = dp_size, B = micro_batch_size; rank r
takes the r-th block of B. Hence a single process with B=D*b sees exactly what D ranks with b see,
concatenated rank-major, and the state is a single global position that stays meaningful when D or
B change on resume (the positions simply continue; a global batch may straddle an epoch boundary,
which is fine because positions, not epochs, define the stream).

Mixing (mixing.py) maps each global position to (source, position in that source's own order);
resampled mode swaps each source's epoch permutation for seeded draws with replacement; buckets
(buckets.py) replace the linear position ranges by per-bucket streams of positions chosen by a
schedule that is a function of (seed, step). All three are pure functions of the seed and a small
state, so the contract above (one state, any D or B on resume) holds for each of them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import weakref
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from common.stop_signals import ignore_in_worker

from .buckets import BucketPlanner, Buckets, assign_index
from .mixing import MixedOrder
from .shards import DataError

log = logging.getLogger(__name__)

# 2 added the dataset fingerprint and the shuffle settings; version-1 states (older
# checkpoints) still resume, with only the checks they allow.
STATE_VERSION = 2

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


class _LinearPlan:
    """Micro-step m covers global positions [start + m*D*B, start + (m+1)*D*B); rank r the r-th B."""

    def __init__(self, batch_size: int, dp_rank: int, dp_size: int, start: int):
        self.B, self.dp_rank, self.dp_size, self.start = batch_size, dp_rank, dp_size, start

    def step(self, m: int) -> tuple[list[int], int | None]:
        first = self.start + (m * self.dp_size + self.dp_rank) * self.B
        return list(range(first, first + self.B)), None


class _BucketPlan:
    """Replays the (cheap, I/O-free) bucket schedule from the stream's start state to step m."""

    def __init__(self, planner: BucketPlanner, dp_rank: int):
        self.planner, self.dp_rank, self.m = planner, dp_rank, 0

    def step(self, m: int) -> tuple[list[int], int | None]:
        if m < self.m:
            raise RuntimeError(f"bucket plan cannot go back from step {self.m} to {m}")
        while self.m < m:
            self.planner.next_step()
            self.m += 1
        k, pos = self.planner.next_step()
        self.m += 1
        B = self.planner.buckets.batch_sizes[k]
        return pos[self.dp_rank * B:(self.dp_rank + 1) * B], k


class _MicroSteps(IterableDataset):
    """Worker w of W produces micro-steps m = w, w+W, w+2W, ... in order.

    torch's DataLoader polls workers round-robin and returns results in task order, so the
    main process receives m = 0, 1, 2, ... exactly, whatever the number of workers.
    """

    def __init__(self, mixed: MixedOrder, plan, decode: Callable[[dict], dict],
                 collate: Callable[[list[dict]], dict], bucket_shapes: list | None):
        self.mixed, self.plan, self.decode, self.collate = mixed, plan, decode, collate
        self.bucket_shapes = bucket_shapes

    def positions(self, m: int) -> list[int]:
        return self.plan.step(m)[0]

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        m = wid
        while True:
            yield self.micro_batch(m)
            m += nw

    def micro_batch(self, m: int) -> dict:
        positions, bucket = self.plan.step(m)
        B = len(positions)
        decoded: list[dict | None] = []
        keys: list[str] = []
        sources: list[int] = []
        for p in positions:
            src, shard_id, sample_id, _ = self.mixed.locate(p)
            raw = self.mixed.read(src, shard_id, sample_id)  # I/O errors are not corruption: raise
            keys.append(raw["__key__"])
            sources.append(src)
            if bucket is not None:
                raw["__bucket__"] = self.bucket_shapes[bucket]  # (frames, h, w) to resize/crop to
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
        if len(bad) == B:
            raise DataError(f"all {B} samples of a micro-batch failed to decode: {keys}")
        # Fill each corrupt slot with the next valid sample cyclically: deterministic, keeps every
        # rank at exactly B samples, and the slot reports the position of the sample actually used.
        used = list(range(B))
        for i in bad:
            j = (i + 1) % B
            while decoded[j] is None:
                j = (j + 1) % B
            used[i] = j
        batch = self.collate([decoded[j] for j in used])
        batch["__position__"] = torch.tensor([positions[j] for j in used], dtype=torch.long)
        batch["__key__"] = [keys[j] for j in used]
        batch["__corrupt__"] = len(bad)
        if len(self.mixed.indexes) > 1:
            batch["__source__"] = torch.tensor([sources[j] for j in used], dtype=torch.long)
        if bucket is not None:
            batch["__bucket__"] = bucket
        return batch


class _BucketLookup:
    """Global position -> bucket id of the sample there (-1: fits none), from the index pass."""

    def __init__(self, mixed: MixedOrder, ids: list[list[np.ndarray]]):
        self.mixed, self.ids = mixed, ids

    def __call__(self, p: int) -> int:
        s, shard, sample, _ = self.mixed.locate(p)
        return int(self.ids[s][shard][sample])


def _parse_sources(sources) -> tuple[list, list[float]]:
    specs, weights = [], []
    for src in sources:
        if isinstance(src, dict):
            path, weight = src.get("path"), src.get("weight", 1.0)
        elif hasattr(src, "path"):
            path, weight = src.path, getattr(src, "weight", 1.0)
        else:
            path, weight = src
        if not path:
            raise DataError(f"data source without a path: {src!r}")
        specs.append(path)
        weights.append(float(weight))
    return specs, weights


class StreamingLoader:
    """Infinite iterator of micro-batches for one data-parallel rank (see module docstring).

    `decode(sample) -> dict` is supplied by the pipeline: `sample` is `{__key__, __url__,
    ext: bytes}` (plus `__bucket__` = (frames, h, w) to resize/crop to when bucketing); an
    exception in it marks the sample corrupt (skipped, counted, logged once per key, its slot
    filled by another sample of the same micro-batch). Each batch is `collate(decoded samples)`
    plus `__position__` (LongTensor[B] of global positions), `__key__` (list[str]), `__corrupt__`
    (int), and with several sources `__source__` (LongTensor[B]), with buckets `__bucket__` (int).

    Options: `sources=[(spec, weight) | {path, weight} | SourceConfig]` mixes several shard sets
    by weight (`shards` is then ignored; see mixing.py); `mode="resampled"` draws with replacement
    by a seeded function of position instead of epoch permutations; `buckets=Buckets(...)` groups
    micro-batches by shape with a per-bucket batch size (`micro_batch_size` is then unused; see
    buckets.py).

    `iter()` always starts at the loader's state: after `load_state_dict` that is the loaded
    position, otherwise it continues where the previous iterator stopped (batches prefetched by
    workers but never handed out are not counted, so they are produced again).
    """

    def __init__(self, shards, decode: Callable[[dict], dict], micro_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, num_workers: int = 2, seed: int = 0,
                 shuffle: bool = True, window: int = 8,
                 collate: Callable[[list[dict]], dict] | None = None, prefetch_factor: int = 2,
                 *, sources=None, mode: str = "epoch", buckets: Buckets | None = None,
                 mix_block: int = 1000, progress: bool = True):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank} dp_size={dp_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if mode not in ("epoch", "resampled"):
            raise ValueError(f"data mode must be 'epoch' or 'resampled', got {mode!r}")
        specs, weights = _parse_sources(sources) if sources else ([shards], [1.0])
        self.mixed = MixedOrder(specs, weights, seed=seed, shuffle=shuffle, window=window,
                                mode=mode, block=mix_block)
        self.index, self.order = self.mixed.indexes[0], self.mixed.orders[0]  # first source
        self.mode, self.mix_block = mode, int(mix_block)
        self.decode, self.collate = decode, collate or default_collate
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.seed = int(seed)
        self.shuffle, self.window = bool(shuffle), int(window)
        self._fingerprint: str | None = None
        self.samples_consumed = 0   # global positions fully consumed (all ranks together)
        self.corrupt_total = 0      # corrupt samples in batches handed out by this loader
        self.buckets = buckets
        self._planner: BucketPlanner | None = None
        if buckets is not None:
            self._bucket_ids = [assign_index(ix, buckets, progress=progress) for ix in self.mixed.indexes]
            self.bucket_skipped = [int(sum((a < 0).sum() for a in ids)) for ids in self._bucket_ids]
            if any(self.bucket_skipped):
                log.warning("buckets: %d of %d samples fit no bucket and are skipped (per source: %s)",
                            sum(self.bucket_skipped), self.num_samples, self.bucket_skipped)
            self._planner = self._new_planner()
        # Weak: a strong reference would make a cycle (the stream's frame holds self), and a
        # DataLoader iterator torn down by the cycle collector waits ~5 s per worker to join.
        self._active: weakref.ref | None = None

    @classmethod
    def from_config(cls, data, decode: Callable[[dict], dict], dp_rank: int = 0, dp_size: int = 1,
                    seed: int = 0, tokens: Callable | None = None, **kw) -> "StreamingLoader":
        """Build from a `DataConfig` (sources, mode, buckets included)."""
        buckets = (Buckets(data.buckets, data.bucket_target_tokens, tokens)
                   if data.buckets else None)
        return cls(data.train_shards, decode, data.micro_batch_size, dp_rank=dp_rank,
                   dp_size=dp_size, num_workers=data.num_workers, seed=seed, shuffle=data.shuffle,
                   window=data.shuffle_window, prefetch_factor=data.prefetch_factor,
                   sources=list(data.sources) or None, mode=data.mode, buckets=buckets,
                   mix_block=data.mix_block, **kw)

    def _new_planner(self) -> BucketPlanner:
        w = np.asarray(self.mixed.weights) / sum(self.mixed.weights)
        shares = np.zeros(len(self.buckets))
        for s, ids in enumerate(self._bucket_ids):
            flat = np.concatenate(ids)
            counts = np.bincount(flat[flat >= 0], minlength=len(self.buckets))
            shares += w[s] * counts / len(flat)
        return BucketPlanner(_BucketLookup(self.mixed, self._bucket_ids), self.buckets, shares,
                             seed=self.seed, dp_size=self.dp_size)

    @property
    def num_samples(self) -> int:
        return sum(self.mixed.source_sizes)

    @property
    def epoch(self) -> int:
        """Epoch of the next position to be read (nominal with several sources or buckets)."""
        return self.samples_consumed // self.num_samples

    @property
    def source_epochs(self) -> list[int]:
        """Per-source epoch of the next position (without buckets)."""
        return self.mixed.source_epochs(self.samples_consumed)

    @property
    def global_batch_per_step(self) -> int:
        return self.micro_batch_size * self.dp_size

    @property
    def fingerprint(self) -> str:
        """Identity of the shards in order: each shard's file name (not its directory, so moved
        data still resumes), sample count and first and last sample key. O(number of shards)."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for ix in self.mixed.indexes:
                for i, (path, n) in enumerate(zip(ix.paths, ix.shard_sizes)):
                    ends = [ix.key(i, 0), ix.key(i, n - 1)] if n else []
                    h.update(repr((os.path.basename(path), int(n), ends)).encode())
                h.update(b"|")  # source boundary
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def _order(self) -> dict:
        """The settings that shape the order (config names); none matter in resampled mode."""
        if self.mode != "epoch":
            return {}
        return {"shuffle": self.shuffle, **({"shuffle_window": self.window} if self.shuffle else {})}

    def _signature(self) -> dict:
        sig: dict = {}
        if len(self.mixed.indexes) > 1:
            sig["sources"] = [[n, w] for n, w in zip(self.mixed.source_sizes, self.mixed.weights)]
            sig["mix_block"] = self.mix_block
        if self.mode != "epoch":
            sig["mode"] = self.mode
        return sig

    def state_dict(self) -> dict:
        sd = {"samples_consumed": self.samples_consumed, "num_samples": self.num_samples,
              "seed": self.seed, "version": STATE_VERSION, "dataset": self.fingerprint,
              **self._order(), **self._signature()}
        if self._planner is not None:
            sd["buckets"] = {"shapes": [list(x) for x in self.buckets.shapes], **self._planner.state()}
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("version") not in (1, STATE_VERSION):
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
        mine = self._signature()
        theirs = {k: sd[k] for k in ("sources", "mix_block", "mode") if k in sd}
        if theirs != mine:
            raise DataError(f"data sources/mode changed: checkpoint has {theirs or 'one source, epoch mode'}, "
                            f"loader has {mine or 'one source, epoch mode'}; an exact resume needs the same")
        legacy = sd["version"] == 1
        if legacy:
            log.warning("data-loader state of an older checkpoint: the shards' identity and the shuffle "
                        "settings cannot be checked; make sure they are the ones it was written with")
        elif sd.get("dataset") != self.fingerprint:
            raise DataError(f"dataset changed: the checkpoint's loader read shards with fingerprint "
                            f"{sd.get('dataset')}, the current shards have {self.fingerprint} (file names, "
                            f"sample counts or first/last keys differ); an exact resume needs the same shards")
        order = {k: sd[k] for k in ("shuffle", "shuffle_window") if k in sd}
        if not legacy and order != self._order():
            mine_s, theirs_s = (", ".join(f"data.{k}={v}" for k, v in d.items()) for d in (self._order(), order))
            raise DataError(f"data order settings changed: checkpoint has {theirs_s}, loader has {mine_s}; "
                            f"the resumed run would repeat and skip samples")
        bst = sd.get("buckets")
        if (bst is None) != (self._planner is None) or (
                bst is not None and [list(x) for x in self.buckets.shapes] != bst["shapes"]):
            raise DataError(f"bucket shapes changed: checkpoint has "
                            f"{bst['shapes'] if bst else 'no buckets'}, loader has "
                            f"{self.buckets.shapes if self.buckets else 'no buckets'}")
        self._close_active()
        self.samples_consumed = int(sd["samples_consumed"])
        if bst is not None:
            self._planner = self._new_planner()
            self._planner.load(bst)

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
        if self._planner is None:
            plan = _LinearPlan(self.micro_batch_size, self.dp_rank, self.dp_size, self.samples_consumed)
        else:  # the stream replays its own copy; self._planner tracks what was handed out
            replay = self._new_planner()
            replay.load(self._planner.state())
            plan = _BucketPlan(replay, self.dp_rank)
        ds = _MicroSteps(self.mixed, plan, self.decode, self.collate,
                         self.buckets.shapes if self.buckets else None)
        if self.num_workers == 0:
            source = iter(ds)
        else:
            dl = DataLoader(ds, batch_size=None, collate_fn=_identity, num_workers=self.num_workers,
                            prefetch_factor=self.prefetch_factor, persistent_workers=False,
                            worker_init_fn=ignore_in_worker)
            source = iter(dl)
        try:
            for batch in source:
                # Counted when handed out, so a checkpoint taken after training on this batch
                # resumes right after it.
                if self._planner is None:
                    self.samples_consumed += self.global_batch_per_step
                else:
                    k, pos = self._planner.next_step()
                    if k != batch["__bucket__"]:
                        raise RuntimeError("bucket schedule diverged between loader and stream")
                    self.samples_consumed += len(pos)
                self.corrupt_total += batch["__corrupt__"]
                yield batch
        finally:
            del source  # last reference: the DataLoader iterator shuts its workers down now
