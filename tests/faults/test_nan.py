"""A NaN/inf loss and a NaN/inf gradient: the step is skipped with the weights, optimizer state
and EMA untouched; train.max_bad_steps of them in a row stop the run with one line."""
from __future__ import annotations

from tests.conftest import read_metrics

from .harness import checkpoint_state, events, same_tensors, step_dir, tail, train


def test_non_finite_loss_and_gradient_steps_are_skipped(synth_data, tmp_path):
    run = str(tmp_path / "run")
    # NaN loss in step 3, inf in one gradient element of step 4; a checkpoint after every step.
    proc = train(run, synth_data, "train.steps=5", "train.ckpt_every=1", "train.max_bad_steps=3",
                 fault_env={"MMP_FAULT_NAN_LOSS_AT_STEP": "3", "MMP_FAULT_NAN_GRAD_AT_STEP": "4",
                            "MMP_FAULT_BAD_VALUE": "inf"})
    assert proc.returncode == 0, tail(proc)
    assert "step 3: non-finite loss (inf)" in proc.stdout and "step 4: non-finite loss" in proc.stdout, tail(proc)
    m = read_metrics(run)
    assert [m[s]["skipped_steps"] for s in range(1, 6)] == [0, 0, 1, 2, 2]
    s2, s3, s4, s5 = (checkpoint_state(step_dir(run, s)) for s in (2, 3, 4, 5))
    assert any(k.startswith("optim.state.") for k in s2) and any(k.startswith("ema.") for k in s2), sorted(s2)[:5]
    assert same_tensors(s2, s3) == [] and same_tensors(s2, s4) == []  # weights, AdamW state, EMA: every bit
    changed = same_tensors(s4, s5)  # step 5 trains again
    assert any(k.startswith("model.") for k in changed) and any(k.startswith("optim.state.") for k in changed)
    assert [e["step"] for e in events(run, "checkpoint")] == [1, 2, 3, 4, 5]


def test_max_bad_steps_in_a_row_stop_the_run(synth_data, tmp_path):
    run = str(tmp_path / "run")
    proc = train(run, synth_data, "train.steps=6", "train.max_bad_steps=2",
                 fault_env={"MMP_FAULT_NAN_LOSS_AT_STEP": "2", "MMP_FAULT_NAN_GRAD_AT_STEP": "3"})
    assert proc.returncode == 2, tail(proc)
    lines = [x for x in proc.stderr.strip().splitlines() if "fault injection:" not in x]
    assert "Traceback" not in proc.stderr and lines == [
        "error: 2 non-finite steps in a row (train.max_bad_steps=2) at step 3; lower optim.lr or check the data"], \
        tail(proc)
    assert max(read_metrics(run)) == 2  # step 3 never completed
