"""common.data buckets: assignment rule, same bucket on every rank, per-bucket batch sizes, exact resume."""

import itertools
import json

import pytest
import torch
import webdataset as wds

from common.data import Buckets, DataError, StreamingLoader, resize_crop, sample_shape

SHAPES = [(32, 32), (24, 40), (16, 16), (2, 16, 16)]
TARGET = 2048  # pixels: batch sizes 2, 2, 8, 4
# (frames, h, w) of the generated samples; (1, 8, 8) and (1, 12, 40) fit no bucket.
SIZES = [(1, 32, 32), (1, 48, 40), (1, 30, 50), (1, 20, 20), (4, 20, 20), (1, 8, 8), (1, 16, 60),
         (1, 12, 40), (3, 40, 40), (1, 24, 40), (1, 64, 17)]


def _write(d, prefix, shards, per):
    d.mkdir()
    for s in range(shards):
        with wds.TarWriter(str(d / f"{s:04d}.tar")) as w:
            for k in range(per):
                i = s * per + k
                f, h, wd = SIZES[(i * 7 + len(prefix)) % len(SIZES)]
                meta = {"width": wd, "height": h} | ({"frames": f} if f > 1 else {})
                w.write({"__key__": f"{prefix}{i:03d}", "json": json.dumps(meta).encode(), "txt": "x"})
    return str(d)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("buckets")
    return {"a": _write(root / "a", "a", 4, 12), "b": _write(root / "b", "bb", 2, 8)}


def decode(sample):
    f, h, w = sample_shape(json.loads(sample["json"]))
    img = torch.arange(f * h * w, dtype=torch.float32).reshape(f, h, w)  # stands in for media
    bf, bh, bw = sample["__bucket__"]
    return {"x": resize_crop(img[:bf], bh, bw), "shape": (f, h, w)}


def make(data, dp_rank=0, dp_size=1, mix=False, **kw):
    kw.setdefault("num_workers", 0)
    src = [{"path": data["a"], "weight": 0.6}, {"path": data["b"], "weight": 0.4}] if mix else None
    return StreamingLoader(data["a"], decode, 1, dp_rank=dp_rank, dp_size=dp_size, window=2,
                           sources=src, buckets=Buckets(SHAPES, TARGET), progress=False, **kw)


def take(loader, n):
    return list(itertools.islice(iter(loader), n))


def test_assignment_rule():
    b = Buckets(SHAPES, TARGET)
    assert b.shapes == [(1, 32, 32), (1, 24, 40), (1, 16, 16), (2, 16, 16)]
    assert b.batch_sizes == [2, 2, 8, 4]
    assert b.assign((1, 32, 32)) == 0          # exact fit
    assert b.assign((1, 48, 40)) == 0          # both fit, 32x32 (1024 px) beats 24x40 (960)
    assert b.assign((1, 30, 50)) == 1          # 32x32 does not fit (h 30 < 32)
    assert b.assign((1, 20, 20)) == 2
    assert b.assign((4, 20, 20)) == 3          # video: 2x16x16 (512) beats 16x16 (256)
    assert b.assign((3, 40, 40)) == 0          # 1x32x32 (1024) beats 2x16x16 (512)
    assert b.assign((1, 8, 8)) == b.assign((1, 12, 40)) == b.assign(None) == -1
    # Equal pixel counts: the closer aspect ratio wins, then the lower index.
    tie = Buckets([(16, 64), (32, 32), (64, 16)], 4096)
    assert tie.assign((1, 40, 100)) == 0 and tie.assign((1, 100, 40)) == 2 and tie.assign((1, 64, 64)) == 1
    assert Buckets([(8, 8), (8, 8, 8)], 100, tokens=lambda s: s[0] * s[1] * s[2] // 4).batch_sizes == [6, 1]
    assert sample_shape({"size": [40, 30], "num_frames": 5}) == (5, 30, 40)
    assert sample_shape({"caption": "no size"}) is None
    with pytest.raises(DataError, match="duplicate"):
        Buckets([(8, 8), (1, 8, 8)], 10)
    img = torch.arange(2 * 30 * 50, dtype=torch.float32).reshape(2, 30, 50)
    assert resize_crop(img, 24, 40).shape == (2, 24, 40) and resize_crop(img, 30, 30).shape == (2, 30, 30)


def test_index_pass_assigns_and_counts_skipped(data):
    ld = make(data)
    b = Buckets(SHAPES, TARGET)
    for shard, ids in enumerate(ld._bucket_ids[0]):
        for i, k in enumerate(ids.tolist()):
            assert k == b.assign(sample_shape(json.loads(ld.index.read(shard, i)["json"])))
    assert ld.bucket_skipped == [sum(int((ids < 0).sum()) for ids in ld._bucket_ids[0])]
    assert ld.bucket_skipped[0] > 0


def _run(data, dp, steps, state=None, mix=False, **kw):
    """`dp` ranks for `steps` micro-steps: per-step checks; returns (positions, keys, state)."""
    per_rank, sds = [], []
    b = Buckets(SHAPES, TARGET)
    for r in range(dp):
        ld = make(data, r, dp, mix=mix, **kw)
        if state is not None:
            ld.load_state_dict(state)
        per_rank.append(take(ld, steps))
        sds.append(ld.state_dict())
    assert all(sd == sds[0] for sd in sds)
    pos, keys = [], []
    for m in range(steps):
        batches = [rk[m] for rk in per_rank]
        k = batches[0]["__bucket__"]
        for bt in batches:
            assert bt["__bucket__"] == k                         # same bucket on every rank
            assert len(bt["__key__"]) == b.batch_sizes[k]        # the bucket's batch size
            assert bt["x"].shape == (b.batch_sizes[k], *b.shapes[k])
            assert all(b.assign(s) == k for s in bt["shape"])   # each sample is in its bucket
            pos += bt["__position__"].tolist()
            keys += bt["__key__"]
    return pos, keys, sds[0]


def _check_prefixes(data, pos, keys, sd, mix):
    """Per bucket, the consumed positions are exactly the first c_k of that bucket's stream."""
    assert len(set(pos)) == len(pos)  # no sample (position) twice
    ref = make(data, mix=mix)
    lookup = ref._planner.bucket_of
    got = dict(zip(pos, keys))
    for k, (cursor, consumed) in enumerate(zip(sd["buckets"]["cursors"], sd["buckets"]["consumed"])):
        stream = [p for p in range(cursor) if lookup(p) == k]
        assert len(stream) == consumed
        assert sorted(p for p in pos if lookup(p) == k) == stream  # nothing skipped in between
    for p, key in got.items():
        s, shard, i, _ = ref.mixed.locate(p)
        assert ref.mixed.indexes[s].key(shard, i) == key
    assert sd["samples_consumed"] == len(pos)


@pytest.mark.parametrize("mix", [False, True])
@pytest.mark.parametrize("dp0,dp1", [(2, 1), (1, 2)])
def test_resume_with_other_dp_size_neither_repeats_nor_skips(data, mix, dp0, dp1):
    pos0, keys0, sd = _run(data, dp0, 6, mix=mix)
    pos1, keys1, sd1 = _run(data, dp1, 9, state=sd, mix=mix)
    assert sd1["buckets"]["step"] == 15
    _check_prefixes(data, pos0 + pos1, keys0 + keys1, sd1, mix)
    # More than one epoch of source a went by: samples recur, but only across epochs.
    assert len(pos0 + pos1) > 48


def test_workers_give_identical_streams(data):
    ref = take(make(data, 1, 2), 6)
    for a, b in zip(ref, take(make(data, 1, 2, num_workers=2), 6), strict=True):
        assert a["__key__"] == b["__key__"] and torch.equal(a["x"], b["x"])


def test_changed_buckets_are_rejected(data):
    sd = make(data).state_dict()
    other = StreamingLoader(data["a"], decode, 1, num_workers=0, window=2, progress=False,
                            buckets=Buckets(SHAPES[:3], TARGET))
    with pytest.raises(DataError, match="bucket shapes changed"):
        other.load_state_dict(sd)
    with pytest.raises(DataError, match="bucket shapes changed"):
        StreamingLoader(data["a"], decode, 1, num_workers=0, window=2).load_state_dict(sd)


def test_synthetic_images_have_a_shape_for_buckets(tmp_path):
    """data.synth writes `size` as a word ("medium") and the side as `image_size`: images must still
    land in a bucket, or joint image-video training silently trains on clips alone."""
    from common.data import ShardIndex, expand_shards
    from data.synth import generate
    generate(str(tmp_path), count=4, heldout_count=0, size=32, shard_size=4, seed=0)
    meta = json.loads(ShardIndex(expand_shards(str(tmp_path / "train"))).read(0, 0)["json"])
    assert isinstance(meta["size"], str) and sample_shape(meta) == (1, 32, 32)
    assert Buckets([(1, 32, 32), (8, 32, 32)], 512).assign(sample_shape(meta)) == 0
