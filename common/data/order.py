"""The one global, deterministic sample order that every rank and worker agrees on."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

# Domain tags keep the shard-permutation and window-permutation random streams independent.
_TAG_SHARDS = 0x5EED_0001
_TAG_WINDOW = 0x5EED_0002


class _Epoch:
    """Per-epoch arrays: O(num_shards) memory, so it scales to billions of samples."""

    def __init__(self, shard_ids: np.ndarray, shard_sizes: np.ndarray, window: int):
        self.shard_ids = shard_ids                        # shards in this epoch's order
        sizes = shard_sizes[shard_ids]
        self.shard_starts = np.concatenate([[0], np.cumsum(sizes)])  # position of each shard's first sample
        self.num_windows = -(-len(shard_ids) // window)
        self.window_first_shard = np.arange(self.num_windows) * window
        self.window_starts = self.shard_starts[self.window_first_shard]


class GlobalOrder:
    """Deterministic, position-addressable sample order: `locate(p)` -> (shard, sample, epoch).

    Epoch e: the shards are permuted with a generator seeded by (seed, e) and cut into consecutive
    windows of `window` shards; the samples inside each window are permuted with a generator seeded
    by (seed, e, window id). This is the position-addressable equivalent of the usual "shuffle the
    shards, stream them through a shuffle buffer": a sample can land anywhere within its window
    (like a buffer spanning `window` shards), but any position can be computed directly, so ranks
    need no communication and a resume needs only one integer. Reading stays shard-local: at any
    moment the loader touches at most a couple of windows, i.e. ~2*window shard files.

    With shuffle=False the order is the shards as given, samples in tar order, every epoch.
    Cost: O(num_shards) to set up an epoch (cached, the last two kept since a batch may straddle
    an epoch boundary), O(window samples) to build a window's permutation (cached, a few kept),
    then O(log num_shards) per `locate`.
    """

    def __init__(self, shard_sizes: Sequence[int], seed: int = 0, shuffle: bool = True,
                 window: int = 8):
        if int(seed) < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if int(window) < 1:
            raise ValueError(f"window must be >= 1 shard, got {window}")
        self.shard_sizes = np.asarray(shard_sizes, dtype=np.int64)
        self.num_samples = int(self.shard_sizes.sum())
        if self.num_samples <= 0:
            raise ValueError("GlobalOrder needs at least one sample")
        self.seed, self.shuffle, self.window = int(seed), bool(shuffle), int(window)
        self._epochs: OrderedDict[int, _Epoch] = OrderedDict()
        self._window_perms: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def _epoch(self, e: int) -> _Epoch:
        ep = self._epochs.get(e)
        if ep is None:
            n = len(self.shard_sizes)
            if self.shuffle:
                shard_ids = np.random.default_rng([_TAG_SHARDS, self.seed, e]).permutation(n)
            else:
                shard_ids = np.arange(n)
            ep = self._epochs[e] = _Epoch(shard_ids, self.shard_sizes, self.window)
            while len(self._epochs) > 2:
                self._epochs.popitem(last=False)
        return ep

    def _window_perm(self, e: int, w: int, size: int) -> np.ndarray:
        perm = self._window_perms.get((e, w))
        if perm is None:
            rng = np.random.default_rng([_TAG_WINDOW, self.seed, e, w])
            perm = self._window_perms[(e, w)] = rng.permutation(size)
            while len(self._window_perms) > 4:
                self._window_perms.popitem(last=False)
        else:
            self._window_perms.move_to_end((e, w))
        return perm

    def locate(self, position: int) -> tuple[int, int, int]:
        """Global position (>= 0, unbounded) -> (shard_id, sample_id, epoch)."""
        position = int(position)
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        e, q = divmod(position, self.num_samples)
        ep = self._epoch(e)
        if self.shuffle:
            # side='right' skips windows/shards of size 0 (they share a start with the next one).
            w = int(np.searchsorted(ep.window_starts, q, side="right")) - 1
            first = int(ep.window_first_shard[w])
            last = min(first + self.window, len(ep.shard_ids))
            w_start = int(ep.window_starts[w])
            w_size = int(ep.shard_starts[last]) - w_start
            q = w_start + int(self._window_perm(e, w, w_size)[q - w_start])
        k = int(np.searchsorted(ep.shard_starts, q, side="right")) - 1
        return int(ep.shard_ids[k]), q - int(ep.shard_starts[k]), e

    def epoch_order(self, epoch: int) -> list[tuple[int, int]]:
        """All (shard_id, sample_id) of one epoch, in order (for tests and inspection)."""
        base = epoch * self.num_samples
        return [self.locate(base + i)[:2] for i in range(self.num_samples)]


_TAG_RESAMPLE = 0x5EED_0003


class ResampledOrder:
    """Sampling with replacement: `locate(p)` draws a sample uniformly by a seeded function of p.

    Positions are grouped in blocks of `block`; block b's draws come from a generator seeded by
    (seed, b), so any position is addressable directly (resume and DP changes stay exact) and
    there is no epoch boundary: `epoch` in the returned triple is the nominal p // num_samples.
    """

    def __init__(self, shard_sizes: Sequence[int], seed: int = 0, block: int = 4096):
        if int(seed) < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.shard_sizes = np.asarray(shard_sizes, dtype=np.int64)
        self.num_samples = int(self.shard_sizes.sum())
        if self.num_samples <= 0:
            raise ValueError("ResampledOrder needs at least one sample")
        self.seed, self.block = int(seed), int(block)
        self.shard_starts = np.concatenate([[0], np.cumsum(self.shard_sizes)])
        self._blocks: OrderedDict[int, np.ndarray] = OrderedDict()

    def _draws(self, b: int) -> np.ndarray:
        d = self._blocks.get(b)
        if d is None:
            rng = np.random.default_rng([_TAG_RESAMPLE, self.seed, b])
            d = self._blocks[b] = rng.integers(0, self.num_samples, self.block)
            while len(self._blocks) > 4:
                self._blocks.popitem(last=False)
        return d

    def locate(self, position: int) -> tuple[int, int, int]:
        position = int(position)
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        b, i = divmod(position, self.block)
        q = int(self._draws(b)[i])
        k = int(np.searchsorted(self.shard_starts, q, side="right")) - 1
        return k, q - int(self.shard_starts[k]), position // self.num_samples


def make_order(shard_sizes: Sequence[int], seed: int = 0, shuffle: bool = True, window: int = 8,
               mode: str = "epoch"):
    """`mode`: epoch (each sample once per epoch, `GlobalOrder`) | resampled (`ResampledOrder`)."""
    if mode == "epoch":
        return GlobalOrder(shard_sizes, seed=seed, shuffle=shuffle, window=window)
    if mode == "resampled":
        return ResampledOrder(shard_sizes, seed=seed)
    raise ValueError(f"data mode must be 'epoch' or 'resampled', got {mode!r}")
