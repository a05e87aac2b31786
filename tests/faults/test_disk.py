"""A full disk (or unwritable run directory) during a save: one line naming the problem, a
non-zero exit, the previous checkpoint intact and resumable."""
from __future__ import annotations

import errno
import os

import pytest

from common.cli import storage_error

from .conftest import REF_STEPS
from .harness import checkpoint_state, latest, same_losses, same_tensors, step_dir, tail, train


@pytest.mark.slow
def test_disk_full_during_save_stops_with_one_line(synth_data, ref_single, tmp_path):
    run = str(tmp_path / "run")
    proc = train(run, synth_data, f"train.steps={REF_STEPS}", fault_env={"MMP_FAULT_SAVE_ERROR": "4"})
    assert proc.returncode == 2, tail(proc)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("error: cannot write: ") and "No space left on device" in lines[0], lines
    assert "step_00000004.tmp" in lines[0]  # names the file
    assert latest(run) == "step_00000002"
    assert same_tensors(checkpoint_state(step_dir(ref_single, 2)), checkpoint_state(step_dir(run, 2))) == []
    # Space freed: the same command resumes from step 2 and ends where the reference did.
    proc = train(run, synth_data, f"train.steps={REF_STEPS}")
    assert proc.returncode == 0, tail(proc)
    assert "resumed from" in proc.stdout and same_losses(ref_single, run, range(3, REF_STEPS + 1)) == []


def test_storage_errors_inside_a_dcp_save_are_one_line():
    """DCP wraps each rank's exception (with its traceback) in a CheckpointException; the message
    names the rank and the storage error, without the traceback."""
    from torch.distributed.checkpoint.api import CheckpointException
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/x/checkpoints/step_00000004.tmp/__1_0.distcp")
    e = CheckpointException("save failed", {1: (full, None), 0: (ValueError("peer"), None)})
    msg = storage_error(e)
    assert msg.startswith("checkpoint save failed on rank 1: cannot write: /runs/x/") and "\n" not in msg, msg
    assert storage_error(CheckpointException("x", {0: (RuntimeError("boom\nmore"), None)})) == \
        "checkpoint save failed on rank 0: RuntimeError: boom"
    assert "read-only" in storage_error(OSError(errno.EROFS, os.strerror(errno.EROFS), "/ro/f")).lower()
    assert storage_error(OSError(errno.EBADF, "bad fd")) is None  # a program bug keeps its traceback
    assert storage_error(KeyError("x")) is None
