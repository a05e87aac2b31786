"""Corrupt samples and a changed data-parallel degree on resume, counted by sample key."""
from __future__ import annotations

import collections

import pytest

from tests.conftest import read_metrics

from .harness import corrupt_copy, events, tail, train, trained_keys

EPOCH = 256  # samples in the synthetic train split: 8 steps of 32 read each exactly once


@pytest.fixture(scope="module")
def corrupt_data(synth_data, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("corrupt") / "data")
    bad = corrupt_copy(synth_data, out, every=100, seed=3)  # ~1%
    return out, bad


@pytest.mark.slow
def test_corrupt_samples_counted_exactly_under_every_dp_layout(corrupt_data, tmp_path):
    """One epoch (every sample read once) in 1 process (32 per micro-batch) and in 2 ranks (16
    each, FSDP): training goes on, and the skip count of every step is that of the injected
    corrupt samples it read, the same in both layouts."""
    data, bad = corrupt_data
    assert 2 <= len(bad) <= 6 and len(set(bad.values())) >= 2, bad
    counts, keys = {}, {}
    for nproc in (1, 2):
        run = str(tmp_path / f"dp{nproc}")
        proc = train(run, data, "train.steps=8", f"data.micro_batch_size={32 // nproc}", "train.ckpt_every=100",
                     nproc=nproc, fault_env={"MMP_FAULT_RECORD_KEYS": "1"})
        assert proc.returncode == 0, tail(proc)
        assert f"corrupt samples {len(bad)};" in proc.stdout, tail(proc)
        m = read_metrics(run)
        counts[nproc] = [m[s]["corrupt_samples"] for s in range(1, 9)]
        keys[nproc] = trained_keys(run)
        # Corrupt samples are never trained on; their slots hold other samples of the batch.
        assert not {k for ks in keys[nproc].values() for k in ks} & set(bad)
        assert all(len(ks) == 32 for ks in keys[nproc].values())
    assert counts[1][-1] == len(bad) and counts[1] == counts[2], counts
    # Per step: the corrupt ones are exactly the epoch's samples that are neither trained nor
    # a duplicate filling a corrupt slot.
    for nproc in (1, 2):
        seen = {k for ks in keys[nproc].values() for k in ks}
        assert len(seen) == EPOCH - len(bad)


@pytest.mark.slow  # 4 runs, 2 of them on 2 ranks
@pytest.mark.parametrize("before,after", [(1, 2), (2, 1)])
def test_resume_under_another_dp_degree_repeats_and_skips_nothing(synth_data, tmp_path, before, after):
    """Stopped after step 5 (checkpoint at 4) under `before` ranks, resumed under `after` ranks
    (global batch 32 both times): over steps 1-8 every key of the epoch is trained exactly once."""
    run = str(tmp_path / "run")
    rec = {"MMP_FAULT_RECORD_KEYS": "1"}
    common = ["train.steps=8", "train.ckpt_every=4"]
    proc = train(run, synth_data, *common, f"data.micro_batch_size={32 // before}", "train.stop_after=5",
                 nproc=before, fault_env=rec)
    assert proc.returncode == 0 and "stopping after step 5" in proc.stdout, tail(proc)
    proc = train(run, synth_data, *common, f"data.micro_batch_size={32 // after}", nproc=after, fault_env=rec)
    assert proc.returncode == 0, tail(proc)
    assert [e["step"] for e in events(run, "resume")] == [4]
    steps = trained_keys(run)
    assert sorted(steps) == list(range(1, 9)) and all(len(k) == 32 for k in steps.values())
    count = collections.Counter(k for ks in steps.values() for k in ks)
    assert len(count) == EPOCH and set(count.values()) == {1}, count.most_common(3)
