"""kill -9 at random steps and in the middle of a synchronous checkpoint write: every resume
reproduces the uninterrupted run bit for bit, and a torn save is never picked."""
from __future__ import annotations

import os

import pytest

from .conftest import REF_STEPS
from .harness import (checkpoint_state, events, kill_and_resume, latest, random_steps, same_losses, same_tensors,
                      step_dir, tail, train)


def resumes_expected(kills: list[int]) -> list[int]:
    """A kill as step k starts leaves the checkpoints of the even steps < k: the next attempt
    resumes from the last of them (none before step 2: a fresh start, no resume event)."""
    return [(k - 1) // 2 * 2 for k in kills if k > 2]


@pytest.mark.slow
def test_sigkill_at_random_steps_single_process(synth_data, ref_single, tmp_path):
    kills = random_steps(seed=16, count=2, lo=2, hi=REF_STEPS)
    got = kill_and_resume(ref_single, str(tmp_path / "run"), synth_data, kills, REF_STEPS)
    assert got["killed"] == len(kills)
    assert got["resumed_from"] == resumes_expected(kills), (kills, got)
    assert got["loss_mismatch"] == [], got
    assert got["weight_mismatch"] == [], got  # model, AdamW moments and EMA, torch.equal


@pytest.mark.slow
def test_sigkill_at_random_steps_two_rank_fsdp(synth_data, tmp_path):
    """torchrun --standalone 2 ranks (FSDP over both), the killed rank chosen by the seed too."""
    steps = 6
    ref = str(tmp_path / "ref")
    proc = train(ref, synth_data, f"train.steps={steps}", nproc=2)
    assert proc.returncode == 0, tail(proc)
    kills = random_steps(seed=17, count=2, lo=2, hi=steps)
    got = kill_and_resume(ref, str(tmp_path / "run"), synth_data, kills, steps, nproc=2, kill_rank=kills[0] % 2)
    assert got["killed"] == 2 and got["resumed_from"] == resumes_expected(kills), (kills, got)
    assert got["loss_mismatch"] == [] and got["weight_mismatch"] == [], got


@pytest.mark.slow
def test_sigkill_between_shard_writes_and_rename(synth_data, ref_single, tmp_path):
    """Killed after every shard of step 4's checkpoint is on disk but before the rename: `latest`
    still names step 2, whose tensors equal the reference's; the resume uses it, never the .tmp."""
    run = str(tmp_path / "run")
    proc = train(run, synth_data, f"train.steps={REF_STEPS}", fault_env={"MMP_FAULT_KILL_IN_SYNC_SAVE": "4"})
    assert proc.returncode == -9, tail(proc)
    ckpts = os.path.join(run, "checkpoints")
    assert sorted(os.listdir(ckpts)) == ["latest", "step_00000002", "step_00000004.tmp"]
    assert any(f.endswith(".distcp") for f in os.listdir(step_dir(run, 4) + ".tmp"))  # the torn save's shards
    assert latest(run) == "step_00000002"
    assert same_tensors(checkpoint_state(step_dir(ref_single, 2)), checkpoint_state(step_dir(run, 2))) == []
    proc = train(run, synth_data, f"train.steps={REF_STEPS}")
    assert proc.returncode == 0, tail(proc)
    assert [e["checkpoint"] for e in events(run, "resume")] == [step_dir(run, 2)]
    assert not any(n.endswith(".tmp") for n in os.listdir(ckpts))  # cleaned up by the next save
    assert same_losses(ref_single, run, range(1, REF_STEPS + 1)) == []
    assert same_tensors(checkpoint_state(step_dir(ref_single, REF_STEPS)),
                        checkpoint_state(step_dir(run, REF_STEPS))) == []
