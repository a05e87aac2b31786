"""train.save_on_signal: a scheduler's SIGTERM / SIGUSR1 (injected as a step starts,
MMP_FAULT_SIGNAL_AT_STEP) ends that step, every rank saves it and the run exits with 128 + the
signal's number; the same command then resumes from that step and ends as the uninterrupted run.
A signal during the last step still completes the run, and the exit code says it came."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from tests.conftest import ROOT, env, wait_until

from .conftest import REF_STEPS
from .harness import (checkpoint_state, events, latest, same_losses, same_tensors, step_dir, tail, train,
                      train_args)


@pytest.mark.slow
def test_sigterm_saves_the_step_in_flight_and_the_rerun_matches_the_uninterrupted_run(synth_data, ref_single,
                                                                                         tmp_path):
    run = str(tmp_path / "run")
    # Step 5 is between the checkpoints of steps 4 and 6 (train.ckpt_every=2).
    # Loader workers too, which get the signal with the rank (a scheduler signals every process of
    # a job step) and must not end before the rank saves; they do not change what is trained on.
    workers = ["data.num_workers=2"]
    # A grace period no step fits in: the first save after a measured step warns, once.
    proc = train(run, synth_data, f"train.steps={REF_STEPS}", *workers, "train.signal_grace_s=0.001",
                 fault_env={"MMP_FAULT_SIGNAL_AT_STEP": "5"})
    assert proc.returncode == 128 + signal.SIGTERM, tail(proc)
    assert "fault injection: SIGTERM at step 5 to the rank and 2 worker(s)" in proc.stderr, tail(proc)
    assert "stopped by SIGTERM at step 5" in proc.stdout, tail(proc)
    assert latest(run) == "step_00000005"
    assert [e["step"] for e in events(run, "stopped")] == [5]
    grace = events(run, "signal_grace")
    assert [e["step"] for e in grace] == [2] and grace[0]["needed_s"] > 0.001, grace
    assert grace[0]["needed_s"] == pytest.approx(grace[0]["step_s"] + grace[0]["write_s"], abs=0.002)
    assert "more than the scheduler's grace period train.signal_grace_s=0.001" in proc.stdout, tail(proc)
    saved = events(run, "saved_on_signal")
    assert [(e["step"], e["signal"]) for e in saved] == [(5, "SIGTERM")] and saved[0]["after_signal_s"] > 0, saved
    assert "checkpoint of step 5 complete" in proc.stdout and "after SIGTERM" in proc.stdout, tail(proc)
    # The rerun gets SIGTERM again as its last step starts: that step and the final save complete
    # as usual, and the exit code still says a signal came (a staged run starts no next stage).
    proc = train(run, synth_data, f"train.steps={REF_STEPS}", *workers,
                 fault_env={"MMP_FAULT_SIGNAL_AT_STEP": str(REF_STEPS)})
    assert proc.returncode == 128 + signal.SIGTERM, tail(proc)
    assert f"done: step {REF_STEPS}" in proc.stdout and "SIGTERM came as the run ended" in proc.stdout, tail(proc)
    assert [e["checkpoint"] for e in events(run, "resume")] == [step_dir(run, 5)]
    assert len(events(run, "signal_grace")) == 1  # the default 30 s: these steps and saves fit
    assert same_losses(ref_single, run, range(1, REF_STEPS + 1)) == []
    assert same_tensors(checkpoint_state(step_dir(ref_single, REF_STEPS)),
                        checkpoint_state(step_dir(run, REF_STEPS))) == []


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(synth_data, tmp_path):
    """SIGUSR1 reaches rank 1 only (Slurm's --signal=USR1@T may reach ranks apart): both ranks
    agree in step 3's all-reduce, save step 3 together (FSDP: each writes its shards; asynchronously,
    so the exit has to wait for the write and for rank 0 to make it `latest`) and exit."""
    run = str(tmp_path / "run")
    layout = ["parallel.dp_mode=fsdp", "train.ckpt_async=true"]
    proc = train(run, synth_data, "train.steps=6", "train.ckpt_every=100", *layout, nproc=2,
                 fault_env={"MMP_FAULT_SIGNAL_AT_STEP": "3", "MMP_FAULT_SIGNAL_RANK": "1",
                            "MMP_FAULT_SIGNAL": "USR1"})
    assert proc.returncode != 0, tail(proc)
    assert f"exitcode: {128 + signal.SIGUSR1}" in proc.stderr, tail(proc)
    assert "SIGUSR1 received by 1 rank(s): saving a checkpoint at step 3" in proc.stdout + proc.stderr, tail(proc)
    assert latest(run) == "step_00000003"
    assert len(checkpoint_state(step_dir(run, 3))) > 0
    # Timed from the signal's arrival on rank 1, although rank 0 (which logs) never got it.
    saved = events(run, "saved_on_signal")
    assert [(e["step"], e["signal"]) for e in saved] == [(3, "SIGUSR1")] and saved[0]["after_signal_s"] > 0, saved
    proc = train(run, synth_data, "train.steps=6", "train.ckpt_every=100", *layout, nproc=2)
    assert proc.returncode == 0, tail(proc)
    assert [e["step"] for e in events(run, "resume")] == [3] and latest(run) == "step_00000006"


def start_slowed(cmd: list[str], seconds_per_step: float, extra_env: dict | None = None, **popen) -> subprocess.Popen:
    """The command started with rank 0 slowed by `seconds_per_step` (MMP_FAULT_SLOW_*), so that a
    signal sent while it trains comes mid-run whatever this machine's speed."""
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**env(), "MMP_FAULT_SLOW_RANK": "0", "MMP_FAULT_SLOW_S": str(seconds_per_step),
                                 **(extra_env or {})}, **popen)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


@pytest.mark.slow
def test_sigusr1_to_every_process_of_a_torchrun_job_saves_restarts_and_finishes(synth_data, tmp_path):
    """As `sbatch --signal=USR1@T launch/slurm.sh` delivers it: SIGUSR1 to the whole job step, with
    torchrun ignoring it as slurm.sh makes it. The ranks save the step in flight and exit 138,
    torchrun restarts them (--max-restarts=1), and they resume from that checkpoint and finish."""
    run = str(tmp_path / "run")
    steps = 40
    cmd = ["bash", "-c", 'trap "" USR1; exec "$@"', "torchrun", sys.executable, "-m", "torch.distributed.run",
           "--standalone", "--nproc_per_node=2", "--max-restarts=1", "--monitor-interval=0.5",
           "-m", "pipelines.text2image.train",
           *train_args(run, synth_data, f"train.steps={steps}", "train.ckpt_every=100", "data.num_workers=1")]
    proc = start_slowed(cmd, 0.2)
    metrics = os.path.join(run, "metrics.jsonl")
    wait_until(proc, lambda: os.path.exists(metrics) and any('"loss"' in line for line in open(metrics)))
    # Slurm signals every process of the step (its cgroup), whatever their sessions: torchrun
    # starts each rank in a session of its own, so the process group would miss them.
    for pid in [proc.pid, *descendants(proc.pid)]:  # the agent, both ranks and their loader workers
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:  # a short-lived helper that has gone since
            pass
    out, err = proc.communicate(timeout=300)
    logs = out + err
    assert proc.returncode == 0, f"rc {proc.returncode}\n{logs[-5000:]}"
    # By 1 or 2 ranks at the agreeing step: a rank waiting inside that step's all-reduce runs its
    # handler only after it returns, and counts from the next step on.
    assert f"exitcode: {128 + signal.SIGUSR1}" in logs, logs[-5000:]
    assert re.search(r"SIGUSR1 received by [12] rank\(s\): saving a checkpoint", logs), logs[-5000:]
    stopped = [e["step"] for e in events(run, "stopped")]
    assert len(stopped) == 1 and 1 <= stopped[0] < steps, stopped
    assert [e["step"] for e in events(run, "resume")] == stopped  # the restart resumed the saved step
    assert latest(run) == f"step_{steps:08d}"


@pytest.mark.slow
def test_ctrl_c_stops_at_once_with_one_line_naming_the_checkpoint_to_resume_from(synth_data, tmp_path):
    """SIGINT is not taken by default: Ctrl-C (to the terminal's whole process group, the loader
    worker included) stops at once, without a traceback, and says where the rerun resumes."""
    run = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "pipelines.text2image.train",
           *train_args(run, synth_data, "train.steps=200", "data.num_workers=1")]
    proc = start_slowed(cmd, 0.1, start_new_session=True)  # a process group of its own, as a terminal's job
    wait_until(proc, lambda: os.path.isdir(step_dir(run, 2)))
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, f"rc {proc.returncode}\n{out[-2000:]}\n{err[-4000:]}"
    assert "Traceback" not in err, err[-4000:]
    line = next(x for x in err.splitlines() if x.startswith("interrupted at step "))
    assert f"the latest checkpoint is {os.path.join(run, 'checkpoints', latest(run))}" in line, line
    assert "the same command resumes from it" in line


@pytest.mark.slow
def test_ctrl_c_during_an_asynchronous_write_waits_for_that_checkpoint(synth_data, tmp_path):
    """The asynchronous writer is a daemon thread: an exit on Ctrl-C would cut it off and lose a
    checkpoint whose data was already on its way to disk. The run waits for it (slow storage:
    MMP_FAULT_SLOW_SAVE_S), says so, and it becomes `latest`."""
    run = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "pipelines.text2image.train",
           *train_args(run, synth_data, "train.steps=200", "train.ckpt_async=true", "data.num_workers=1")]
    proc = start_slowed(cmd, 0.1, {"MMP_FAULT_SLOW_SAVE_S": "4"}, start_new_session=True)
    # DCP's .metadata comes last in the writer thread: the step's own save() has long returned.
    written = os.path.join(run, "checkpoints", "step_00000002.tmp", ".metadata")
    wait_until(proc, lambda: os.path.exists(written))
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, f"rc {proc.returncode}\n{out[-2000:]}\n{err[-4000:]}"
    assert "Traceback" not in err, err[-4000:]
    assert "interrupted: waiting for the checkpoint of step 2, still being written" in err, err[-4000:]
    assert latest(run) == "step_00000002" and len(checkpoint_state(step_dir(run, 2))) > 0
    line = next(x for x in err.splitlines() if x.startswith("interrupted at step "))
    assert f"the latest checkpoint is {step_dir(run, 2)}" in line, line
