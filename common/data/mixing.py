"""Weighted mixing of several shard sources into one position-addressable stream.

Schedule (a pure function of (seed, global position)): positions are cut into blocks of `block`
(default 1000). Every block holds exactly `c_s` slots of source s, where `c` is the
largest-remainder apportionment of `weights * block` (so c_s/block is within 1/block of w_s);
the slots are arranged in a random order seeded by (seed, block id). Position p in block b at slot
i maps to source s = arrangement_b[i] and to position `b * c_s + (#slots of s before i in the
block)` in that source's own order (`GlobalOrder` / `ResampledOrder`), so each source keeps its
own epoch counter (a small source is simply repeated more often). Over any whole number of blocks
the realised mixture equals `c / block` exactly; over a partial block it is off by at most one
block's worth of slots. Nothing depends on the number of ranks or on history, which is why a
resume (one integer) and a DP-degree change stay exact.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from .order import make_order
from .shards import DataError, ShardIndex, expand_shards

_TAG_MIX = 0x5EED_0004
_TAG_SOURCE_SEED = 0x5EED_0005


def apportion(weights: Sequence[float], total: int) -> np.ndarray:
    """Largest-remainder apportionment of `total` slots by `weights` (ties: lower index)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise DataError(f"source weights must be finite, >= 0 and not all 0, got {list(weights)}")
    exact = w / w.sum() * total
    counts = np.floor(exact).astype(np.int64)
    rest = total - int(counts.sum())
    order = sorted(range(len(w)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:rest]:
        counts[i] += 1
    return counts


class MixSchedule:
    """Global position -> (source, position within that source); see the module docstring."""

    def __init__(self, weights: Sequence[float], seed: int = 0, block: int = 1000):
        if int(block) < 1:
            raise ValueError(f"mixing block must be >= 1, got {block}")
        self.block, self.seed = int(block), int(seed)
        self.counts = apportion(weights, self.block)
        starved = [i for i, (wt, c) in enumerate(zip(weights, self.counts)) if wt > 0 and c == 0]
        if starved:
            raise DataError(f"source(s) {starved} have weights too small for a mixing block of "
                            f"{self.block} positions: raise the block size or the weights")
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def _arrangement(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        got = self._cache.get(b)
        if got is None:
            slots = np.repeat(np.arange(len(self.counts)), self.counts)
            if len(self.counts) > 1:
                slots = np.random.default_rng([_TAG_MIX, self.seed, b]).permutation(slots)
            rank = np.empty(self.block, dtype=np.int64)
            seen = np.zeros(len(self.counts), dtype=np.int64)
            for i, s in enumerate(slots):  # O(block) once per block, then cached
                rank[i] = seen[s]
                seen[s] += 1
            got = self._cache[b] = (slots, rank)
            while len(self._cache) > 8:
                self._cache.popitem(last=False)
        return got

    def locate(self, position: int) -> tuple[int, int]:
        if len(self.counts) == 1:
            return 0, int(position)
        b, i = divmod(int(position), self.block)
        slots, rank = self._arrangement(b)
        s = int(slots[i])
        return s, b * int(self.counts[s]) + int(rank[i])


def source_seed(seed: int, i: int, n_sources: int) -> int:
    """A lone source keeps the run seed (the single-source order is unchanged); several get
    independent derived seeds so equally sized sources are not shuffled identically."""
    if n_sources == 1:
        return int(seed)
    return int(np.random.SeedSequence([_TAG_SOURCE_SEED, int(seed), i]).generate_state(1)[0] >> 1)


class MixedOrder:
    """Global position -> (source, shard, sample, epoch of that source) over weighted sources."""

    def __init__(self, specs: Sequence, weights: Sequence[float], seed: int = 0,
                 shuffle: bool = True, window: int = 8, mode: str = "epoch", block: int = 1000):
        if len(specs) != len(weights) or not specs:
            raise DataError("need one weight per source and at least one source")
        self.indexes = [s if isinstance(s, ShardIndex) else ShardIndex(expand_shards(s)) for s in specs]
        self.weights = [float(w) for w in weights]
        self.schedule = MixSchedule(self.weights, seed=seed, block=block)
        n = len(self.indexes)
        self.orders = [make_order(ix.shard_sizes, seed=source_seed(seed, i, n), shuffle=shuffle,
                                  window=window, mode=mode) for i, ix in enumerate(self.indexes)]

    @property
    def source_sizes(self) -> list[int]:
        return [ix.num_samples for ix in self.indexes]

    def locate(self, position: int) -> tuple[int, int, int, int]:
        s, q = self.schedule.locate(position)
        shard, sample, epoch = self.orders[s].locate(q)
        return s, shard, sample, epoch

    def source_epochs(self, consumed: int) -> list[int]:
        """Per-source epoch of the next position after `consumed` global positions."""
        b, i = divmod(int(consumed), self.schedule.block) if len(self.indexes) > 1 else (0, 0)
        out = []
        for s, n in enumerate(self.source_sizes):
            if len(self.indexes) == 1:
                q = consumed
            else:
                slots, _ = self.schedule._arrangement(b)
                q = b * int(self.schedule.counts[s]) + int(np.count_nonzero(slots[:i] == s))
            out.append(q // n)
        return out

    def read(self, s: int, shard: int, sample: int) -> dict:
        return self.indexes[s].read(shard, sample)
