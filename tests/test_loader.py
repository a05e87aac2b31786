"""common.data: tar index, global order, DP-exact slicing, workers, resume, corrupt samples."""

import itertools
import logging

import pytest
import torch
import webdataset as wds

from common.data import DataError, GlobalOrder, ShardIndex, StreamingLoader, expand_shards

NUM_SHARDS, PER_SHARD = 5, 7
N = NUM_SHARDS * PER_SHARD


def _payload(i: int) -> bytes:
    return bytes((i * 31 + j) % 256 for j in range(3 + i % 11))  # varied sizes, not 512-aligned


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    for s in range(NUM_SHARDS):
        with wds.TarWriter(str(d / f"shard-{s:06d}.tar")) as w:
            for k in range(PER_SHARD):
                i = s * PER_SHARD + k
                w.write({"__key__": f"s{i:05d}", "cls": i, "txt": f"caption {i}", "bin": _payload(i)})
    return d


def decode(sample):
    return {"cls": torch.tensor(int(sample["cls"])), "txt": sample["txt"].decode()}


def make(shard_dir, B, **kw):
    kw.setdefault("num_workers", 0)
    kw.setdefault("window", 2)
    return StreamingLoader(str(shard_dir), decode, B, **kw)


def take(loader, n):
    return list(itertools.islice(iter(loader), n))


def test_expand_shards_forms(shard_dir):
    files = [str(shard_dir / f"shard-{s:06d}.tar") for s in range(NUM_SHARDS)]
    assert expand_shards(str(shard_dir)) == files
    assert expand_shards(str(shard_dir / "shard-{000000..000004}.tar")) == files
    assert expand_shards(str(shard_dir / "*.tar")) == files
    assert expand_shards([files[3], str(shard_dir / "shard-00000{0..1}.tar")]) == [files[3]] + files[:2]


def test_index_reads_every_sample_byte_exact(shard_dir):
    idx = ShardIndex(expand_shards(str(shard_dir)))
    assert idx.num_samples == N and idx.shard_sizes == [PER_SHARD] * NUM_SHARDS
    for s, k in itertools.product(range(NUM_SHARDS), range(PER_SHARD)):
        i = s * PER_SHARD + k
        got = idx.read(s, k)
        assert got == {"__key__": f"s{i:05d}", "__url__": idx.paths[s], "cls": str(i).encode(),
                       "txt": f"caption {i}".encode(), "bin": _payload(i)}


def test_global_order_is_a_deterministic_permutation():
    sizes = [7, 0, 3, 5, 1, 0, 6]  # uneven and empty shards
    everything = sorted((s, k) for s, n in enumerate(sizes) for k in range(n))
    o = GlobalOrder(sizes, seed=3, window=2)
    e0, e1 = o.epoch_order(0), o.epoch_order(1)
    assert sorted(e0) == everything and sorted(e1) == everything
    assert e0 != e1
    assert GlobalOrder(sizes, seed=4, window=2).epoch_order(0) != e0
    assert GlobalOrder(sizes, seed=3, window=2).epoch_order(0) == e0  # fresh instance: same order
    assert o.epoch_order(0) == e0                                       # repeated calls: same order
    n = sum(sizes)
    assert o.locate(5 * n + 4) == (*o.epoch_order(5)[4], 5)
    assert GlobalOrder(sizes, shuffle=False).epoch_order(2) == everything
    # Windowing: each run of positions belonging to one window uses only that window's shards.
    ep = o._epoch(0)
    starts = [int(x) for x in ep.window_starts] + [n]
    for w in range(ep.num_windows):
        shards = set(int(x) for x in ep.shard_ids[w * 2:(w + 1) * 2])
        assert {s for s, _ in e0[starts[w]:starts[w + 1]]} <= shards


def _concat(batches):
    return (torch.cat([b["cls"] for b in batches]), torch.cat([b["__position__"] for b in batches]),
            sum((b["__key__"] for b in batches), []), sum((b["txt"] for b in batches), []))


def test_dp_ranks_concatenated_equal_single_process(shard_dir):
    steps = 10  # 80 positions: crosses two epoch boundaries of 35
    single = take(make(shard_dir, 8), steps)
    ranks = [take(make(shard_dir, 4, dp_rank=r, dp_size=2), steps) for r in range(2)]
    for m in range(steps):
        assert len(ranks[0][m]["__key__"]) == 4
        merged = _concat([ranks[0][m], ranks[1][m]])
        want = _concat([single[m]])
        assert torch.equal(merged[0], want[0]) and torch.equal(merged[1], want[1])
        assert merged[2:] == want[2:]
        assert torch.equal(want[1], torch.arange(8 * m, 8 * m + 8))
    # Every sample of epoch 0 appears exactly once in the first 35 positions.
    cls, pos, _, _ = _concat(single)
    assert sorted(cls[pos < N].tolist()) == list(range(N))


def test_num_workers_give_identical_streams(shard_dir):
    streams = [take(make(shard_dir, 3, num_workers=w, dp_rank=1, dp_size=2), 7) for w in (0, 1, 2)]
    ref = streams[0]
    assert [b["__position__"].tolist() for b in ref] == [list(range(6 * m + 3, 6 * m + 6)) for m in range(7)]
    for other in streams[1:]:
        for a, b in zip(ref, other, strict=True):
            assert torch.equal(a["cls"], b["cls"]) and torch.equal(a["__position__"], b["__position__"])
            assert a["__key__"] == b["__key__"] and a["txt"] == b["txt"]


def test_resume_is_exact(shard_dir):
    full = take(make(shard_dir, 4), 9)
    first = make(shard_dir, 4, num_workers=2)  # workers prefetch ahead: they must not count
    it = iter(first)
    for _ in range(3):
        next(it)
    sd = first.state_dict()
    assert sd == {"samples_consumed": 12, "num_samples": N, "seed": 0, "version": 2,
                  "dataset": first.fingerprint, "shuffle": True, "shuffle_window": 2}
    resumed = make(shard_dir, 4)
    resumed.load_state_dict(sd)
    assert resumed.epoch == 0
    for a, b in zip(full[3:], take(resumed, 6), strict=True):
        assert torch.equal(a["cls"], b["cls"]) and a["__key__"] == b["__key__"]
    assert resumed.samples_consumed == 36 and resumed.epoch == 1
    # A second iter() continues where the first stopped; without a load it never rewinds.
    assert next(iter(resumed))["__position__"].tolist() == [36, 37, 38, 39]


def _run_ranks(shard_dir, B, dp, steps, state=None):
    """Simulate `dp` ranks for `steps` micro-steps; returns (positions, keys, state)."""
    pos, keys, sds = [], [], []
    for r in range(dp):
        ld = make(shard_dir, B, dp_rank=r, dp_size=dp)
        if state is not None:
            ld.load_state_dict(state)
        for b in take(ld, steps):
            pos += b["__position__"].tolist()
            keys += b["__key__"]
        sds.append(ld.state_dict())
    assert all(sd == sds[0] for sd in sds)  # every rank agrees on the global state
    return pos, keys, sds[0]


@pytest.mark.parametrize("before,after", [((2, 2), (1, 3)), ((1, 5), (2, 3))])
def test_resume_with_other_dp_size_neither_repeats_nor_skips(shard_dir, before, after):
    (dp0, b0), (dp1, b1) = before, after
    pos0, keys0, sd = _run_ranks(shard_dir, b0, dp0, steps=3)
    assert sd["samples_consumed"] == 3 * dp0 * b0
    remaining = N - sd["samples_consumed"]
    steps1 = -(-remaining // (dp1 * b1))  # enough to finish the epoch (may spill into the next)
    pos1, keys1, _ = _run_ranks(shard_dir, b1, dp1, steps=steps1, state=sd)
    epoch0 = [(p, k) for p, k in zip(pos0 + pos1, keys0 + keys1) if p < N]
    assert sorted(p for p, _ in epoch0) == list(range(N))             # no position twice or missed
    assert sorted(k for _, k in epoch0) == [f"s{i:05d}" for i in range(N)]  # each sample once


def test_corrupt_sample_is_skipped_counted_and_replaced(shard_dir, caplog):
    bad_key = "s00010"

    def fragile(sample):
        if sample["__key__"] == bad_key:
            raise ValueError("truncated payload")
        return decode(sample)

    ld = StreamingLoader(str(shard_dir), fragile, 5, num_workers=0, window=2)
    with caplog.at_level(logging.WARNING, logger="common.data.loader"):
        batches = take(ld, 14)  # two epochs
    hit = [b for b in batches if b["__corrupt__"]]
    assert len(hit) == 2 and ld.corrupt_total == 2
    assert sum("s00010" in r.getMessage() for r in caplog.records) == 1  # logged once per key
    for b in hit:
        assert b["__corrupt__"] == 1 and len(b["__key__"]) == 5 and b["cls"].shape == (5,)
        assert bad_key not in b["__key__"] and len(set(b["__key__"])) == 4  # one copy fills the slot
        pos = b["__position__"].tolist()
        assert len(set(pos)) == 4
        i = next(i for i in range(5) if pos[i] == pos[(i + 1) % 5])  # filled by the next valid slot
        assert b["__key__"][i] == b["__key__"][(i + 1) % 5]
    # Every slot, replaced ones included, reports the position of the sample actually used.
    order = GlobalOrder([PER_SHARD] * NUM_SHARDS, window=2)
    for b in batches:
        for p, k, c in zip(b["__position__"].tolist(), b["__key__"], b["cls"].tolist()):
            s, i, _ = order.locate(p)
            assert k == f"s{s * PER_SHARD + i:05d}" and c == s * PER_SHARD + i


def test_micro_batch_of_only_corrupt_samples_raises(shard_dir):
    def broken(sample):
        raise OSError("bad")

    with pytest.raises(DataError, match=r"all 2 samples .*failed to decode.*s\d{5}"):
        take(StreamingLoader(str(shard_dir), broken, 2, num_workers=0), 1)
    with pytest.raises(DataError, match="failed to decode"):  # re-raised from a worker process
        take(StreamingLoader(str(shard_dir), broken, 2, num_workers=1), 1)


def test_clear_errors(shard_dir, tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        expand_shards(str(tmp_path / "nope.tar"))
    with pytest.raises(DataError, match="matches no files"):
        expand_shards(str(shard_dir / "other-{000..003}.tar"))
    with pytest.raises(DataError, match="matches no files"):
        expand_shards(str(shard_dir / "other-*.tar"))
    with pytest.raises(DataError, match="2 of 7 shards do not exist"):
        expand_shards(str(shard_dir / "shard-{000000..000006}.tar"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="contains no .tar files"):
        expand_shards(str(empty))
    for i in range(2):
        with wds.TarWriter(str(empty / f"e{i}.tar")):
            pass
    with pytest.raises(DataError, match="dataset is empty: 0 samples in 2 shard"):
        StreamingLoader(str(empty), decode, 2)
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"this is not a tar archive" * 50)
    with pytest.raises(DataError, match="junk.tar.*not a valid tar"):
        ShardIndex([str(junk)])
    ld = make(shard_dir, 2)
    with pytest.raises(DataError, match="dataset changed.*34.*35"):
        ld.load_state_dict({"samples_consumed": 4, "num_samples": 34, "seed": 0, "version": 1})
    with pytest.raises(DataError, match="seed changed"):
        ld.load_state_dict({"samples_consumed": 4, "num_samples": N, "seed": 9, "version": 1})


def test_from_config_and_resampled_order(shard_dir):
    from common.config import DataConfig
    from common.data import ResampledOrder

    cfg = DataConfig(train_shards=str(shard_dir), micro_batch_size=4, num_workers=0, shuffle_window=2)
    a = take(StreamingLoader.from_config(cfg, decode, seed=3), 3)
    b = take(make(shard_dir, 4, seed=3), 3)
    assert [x["__key__"] for x in a] == [x["__key__"] for x in b]
    o = ResampledOrder([PER_SHARD] * NUM_SHARDS, seed=1, block=16)
    draws = [o.locate(p) for p in range(100)]
    assert draws == [ResampledOrder([PER_SHARD] * NUM_SHARDS, seed=1, block=16).locate(p) for p in range(100)]
    assert all(0 <= s < NUM_SHARDS and 0 <= i < PER_SHARD for s, i, _ in draws)
    assert len(set(draws)) < 100 and draws[99][2] == 99 // N
