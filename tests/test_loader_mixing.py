"""common.data mixing: weighted sources, per-source epochs, resampled mode, exact resume under DP changes."""

import itertools
from collections import Counter

import pytest
import torch
import webdataset as wds

from common.data import DataError, MixSchedule, StreamingLoader

SIZES = {"a": (2, 10), "b": (1, 7), "c": (3, 5)}  # name: (shards, samples per shard)
WEIGHTS = {"a": 0.5, "b": 0.3, "c": 0.2}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    out = []
    for name, (ns, per) in SIZES.items():
        d = root / name
        d.mkdir()
        for s in range(ns):
            with wds.TarWriter(str(d / f"{s:04d}.tar")) as w:
                for k in range(per):
                    i = s * per + k
                    w.write({"__key__": f"{name}{i:03d}", "cls": i, "txt": f"{name} {i}"})
        out.append({"path": str(d), "weight": WEIGHTS[name]})
    return out


def decode(sample):
    return {"cls": torch.tensor(int(sample["cls"]))}


def make(sources, B, **kw):
    kw.setdefault("num_workers", 0)
    kw.setdefault("window", 2)
    return StreamingLoader(None, decode, B, sources=sources, **kw)


def take(loader, n):
    return list(itertools.islice(iter(loader), n))


def flat(batches, field):
    out = []
    for b in batches:
        v = b[field]
        out += v.tolist() if isinstance(v, torch.Tensor) else list(v)
    return out


def test_schedule_is_exact_per_block_and_a_bijection():
    sch = MixSchedule([0.5, 0.3, 0.2], seed=7, block=100)
    assert sch.counts.tolist() == [50, 30, 20]
    got = [sch.locate(p) for p in range(1000)]
    assert got == [MixSchedule([5, 3, 2], seed=7, block=100).locate(p) for p in range(1000)]  # pure
    for s, c in enumerate([50, 30, 20]):
        qs = [q for src, q in got if src == s]
        assert qs == list(range(10 * c))  # each source's positions are consumed in order, once
        for b in range(10):
            assert sum(src == s for src, _ in got[b * 100:(b + 1) * 100]) == c
    # Largest remainder: 1/3 each over 100 slots -> 34/33/33; tiny weights are rejected.
    assert MixSchedule([1, 1, 1], block=100).counts.tolist() == [34, 33, 33]
    with pytest.raises(DataError, match="too small"):
        MixSchedule([1.0, 0.001], block=100)


def test_realised_mixture_and_per_source_epochs(sources):
    ld = make(sources, 250)
    batches = take(ld, 40)  # 10k samples
    src = flat(batches, "__source__")
    keys = flat(batches, "__key__")
    cnt = Counter(src)
    for s, name in enumerate(SIZES):
        assert abs(cnt[s] / len(src) - WEIGHTS[name]) < 0.02
        # Each source has its own epochs: every run of n_s of its samples is a permutation.
        n = SIZES[name][0] * SIZES[name][1]
        mine = [k for k, x in zip(keys, src) if x == s]
        for e in range(len(mine) // n):
            assert sorted(mine[e * n:(e + 1) * n]) == sorted(f"{name}{i:03d}" for i in range(n))
    assert ld.source_epochs == [cnt[s] // (SIZES[nm][0] * SIZES[nm][1]) for s, nm in enumerate(SIZES)]


@pytest.mark.parametrize("mode", ["epoch", "resampled"])
def test_dp_ranks_concatenated_equal_single_process(sources, mode):
    single = take(make(sources, 8, mode=mode), 12)
    ranks = [take(make(sources, 4, dp_rank=r, dp_size=2, mode=mode), 12) for r in range(2)]
    for m in range(12):
        for f in ("__position__", "__key__", "__source__", "cls"):
            assert flat([ranks[0][m], ranks[1][m]], f) == flat([single[m]], f)


def _run(sources, B, dp, steps, state=None, **kw):
    pos, keys, sds = [], [], []
    for r in range(dp):
        ld = make(sources, B, dp_rank=r, dp_size=dp, **kw)
        if state is not None:
            ld.load_state_dict(state)
        bs = take(ld, steps)
        pos += flat(bs, "__position__")
        keys += flat(bs, "__key__")
        sds.append(ld.state_dict())
    assert all(sd == sds[0] for sd in sds)
    return pos, keys, sds[0]


@pytest.mark.parametrize("mode", ["epoch", "resampled"])
@pytest.mark.parametrize("before,after", [((2, 3), (1, 4)), ((1, 5), (2, 3))])
def test_resume_with_other_dp_size_neither_repeats_nor_skips(sources, mode, before, after):
    (dp0, b0), (dp1, b1) = before, after
    pos0, keys0, sd = _run(sources, b0, dp0, 4, mode=mode)
    assert sd["samples_consumed"] == 4 * dp0 * b0 and len(sd["sources"]) == 3
    assert sd.get("mode", "epoch") == mode
    pos1, keys1, sd1 = _run(sources, b1, dp1, 6, state=sd, mode=mode)
    total = sd1["samples_consumed"]
    ref_pos, ref_keys, _ = _run(sources, 1, 1, total, mode=mode)  # uninterrupted single process
    got = dict(zip(pos0 + pos1, keys0 + keys1))
    assert len(got) == len(pos0 + pos1) == total          # no position twice
    assert sorted(got) == ref_pos == list(range(total))   # none missed
    assert [got[p] for p in ref_pos] == ref_keys           # the same sample at every position


def test_resampled_draws_with_replacement(sources):
    ld = make(sources[:1], 20, mode="resampled")
    keys = flat(take(ld, 5), "__key__")
    assert len(set(keys[:20])) < 20  # 20 draws from 20 samples: a repeat is near certain
    assert len(set(keys)) == 20       # ...and 100 draws see every one of them
    assert ld.state_dict()["mode"] == "resampled"


def test_changed_sources_or_mode_are_rejected(sources):
    sd = make(sources, 2).state_dict()
    with pytest.raises(DataError, match="sources/mode changed"):
        make(sources[:2] + [dict(sources[2], weight=0.4)], 2).load_state_dict(sd)
    with pytest.raises(DataError, match="sources/mode changed"):
        make(sources, 2, mode="resampled").load_state_dict(sd)
    with pytest.raises(DataError, match="sources/mode changed"):
        StreamingLoader(sources[0]["path"], decode, 2, num_workers=0).load_state_dict(
            dict(sd, num_samples=20))
