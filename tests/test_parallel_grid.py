"""Every parallel layout trains the same model as one process (DESIGN: the correctness rule).

Each layout runs the real entrypoint with torchrun's rank variables (gloo, fp32, 2 to 16 ranks,
forked by tests/forked_runs.py) for 5 optimizer steps with the same global batch (8 samples) and
seed as the single-process run. Per step, the loss and the gradient norm must match within rtol
1e-5; afterwards the checkpoint, loaded into one process (so every shard is gathered to a full
tensor by DCP), must hold the same weights (rtol 1e-5, atol 1e-6), and the same EMA weights
(what sample and eval use; train.ema_decay=0.9 with its warmup keeps them apart from the
weights). Only the order of floating-point reductions differs between layouts.

A checkpoint written under one layout must resume under another with the losses continuing as
if uninterrupted; the data loader's position is a global sample count, so changing the DP
degree neither repeats nor skips a sample (training noise is seeded per sample, so a repeated or
skipped sample would change the loss).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import assert_same_training, run_train, shared_once
from tests.conftest import final_weights as conftest_final_weights

pytestmark = [pytest.mark.slow, pytest.mark.dist]

STEPS = 5
GLOBAL_BATCH = 8
COMMON = [f"train.steps={STEPS}", "train.log_every=1", "train.ckpt_every=100", "train.sample_every=0",
          "sample.num=0", "train.ema_decay=0.9", "model.depth=4"]

# name: (processes, overrides). Micro batch x grad_accum x dp = 8 in every layout.
LAYOUTS = {
    "ddp": (2, ["data.micro_batch_size=4", "parallel.dp_mode=ddp"]),
    "ddp-accum2": (2, ["data.micro_batch_size=2", "train.grad_accum=2", "parallel.dp_mode=ddp"]),
    "fsdp-zero3": (2, ["data.micro_batch_size=4", "parallel.dp_mode=fsdp"]),
    "fsdp-zero2": (2, ["data.micro_batch_size=4", "parallel.dp_mode=fsdp", "parallel.reshard_after_forward=false"]),
    "hsdp-2x2": (4, ["data.micro_batch_size=2", "parallel.dp_replicate=2", "parallel.dp_shard=2"]),
    "tp2": (2, ["data.micro_batch_size=8", "parallel.tp=2", "parallel.sequence_parallel=false"]),
    "tp2-sp": (2, ["data.micro_batch_size=8", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    "cp2-ulysses": (2, ["data.micro_batch_size=8", "parallel.cp=2", "parallel.cp_mode=ulysses"]),
    "cp2-ring": (2, ["data.micro_batch_size=8", "parallel.cp=2", "parallel.cp_mode=ring"]),
    "cp4-hybrid-2x2": (4, ["data.micro_batch_size=8", "parallel.cp=4", "parallel.cp_mode=hybrid", "parallel.cp_ulysses=2"]),
    "pp2-1f1b": (2, ["data.micro_batch_size=4", "train.grad_accum=2", "parallel.pp=2", "parallel.pp_schedule=1f1b"]),
    "pp2-interleaved": (2, ["data.micro_batch_size=4", "train.grad_accum=2", "parallel.pp=2",
                            "parallel.pp_schedule=interleaved"]),
    "pp2-zero-bubble": (2, ["data.micro_batch_size=4", "train.grad_accum=2", "parallel.pp=2",
                            "parallel.pp_schedule=zero_bubble"]),
    "fsdp2xtp2": (4, ["data.micro_batch_size=4", "parallel.dp_shard=2", "parallel.tp=2"]),
    "fsdp2xcp2": (4, ["data.micro_batch_size=4", "parallel.dp_shard=2", "parallel.cp=2", "parallel.cp_mode=ring"]),
    "hsdp2x1xcp2": (4, ["data.micro_batch_size=4", "parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.cp=2",
                        "parallel.cp_mode=ring"]),
    "tp2xpp2": (4, ["data.micro_batch_size=4", "train.grad_accum=2", "parallel.tp=2", "parallel.pp=2"]),
    # Compositions (common/parallel/layouts.py): data parallelism inside pipeline stages, CP x TP.
    "pp2xfsdp2": (4, ["data.micro_batch_size=2", "train.grad_accum=2", "parallel.pp=2", "parallel.dp_shard=2"]),
    "pp2xfsdp2-zero2-interleaved": (4, ["data.micro_batch_size=2", "train.grad_accum=2", "parallel.pp=2",
                                        "parallel.dp_shard=2", "parallel.reshard_after_forward=false",
                                        "parallel.pp_schedule=interleaved"]),
    "pp2xddp2": (4, ["data.micro_batch_size=2", "train.grad_accum=2", "parallel.pp=2", "parallel.dp_mode=ddp"]),
    "pp2xcp2": (4, ["data.micro_batch_size=4", "train.grad_accum=2", "parallel.pp=2", "parallel.cp=2",
                    "parallel.cp_mode=ring"]),
    "cp2xtp2": (4, ["data.micro_batch_size=8", "parallel.cp=2", "parallel.cp_mode=ring", "parallel.tp=2",
                   "parallel.sequence_parallel=false"]),
    "cp2xtp2-sp": (4, ["data.micro_batch_size=8", "parallel.cp=2", "parallel.cp_mode=ring", "parallel.tp=2",
                      "parallel.sequence_parallel=true"]),
    "pp2xfsdp2xtp2": (8, ["data.micro_batch_size=2", "train.grad_accum=2", "parallel.pp=2", "parallel.dp_shard=2",
                          "parallel.tp=2"]),
    "pp2xhsdp2x2": (8, ["data.micro_batch_size=1", "train.grad_accum=2", "parallel.pp=2", "parallel.dp_replicate=2",
                        "parallel.dp_shard=2"]),
    # 4-D: every degree 2 on 16 ranks.
    "pp2xfsdp2xcp2xtp2": (16, ["data.micro_batch_size=2", "train.grad_accum=2", "parallel.pp=2",
                               "parallel.dp_shard=2", "parallel.cp=2", "parallel.tp=2", "parallel.cp_mode=ring"]),
    "pp2xcp2xtp2": (8, ["data.micro_batch_size=4", "train.grad_accum=2", "parallel.pp=2", "parallel.cp=2",
                        "parallel.tp=2", "parallel.cp_mode=ring"]),
    # Activation checkpointing and compile change how a step is computed, never what.
    "fsdp-ac-full": (2, ["data.micro_batch_size=4", "parallel.dp_mode=fsdp", "parallel.activation_checkpoint=full"]),
    "tp2-sp-ac-selective": (2, ["data.micro_batch_size=8", "parallel.tp=2", "parallel.activation_checkpoint=selective"]),
    "cp2-ulysses-ac-offload": (2, ["data.micro_batch_size=8", "parallel.cp=2", "parallel.activation_checkpoint=offload"]),
    "fsdp-compile": (2, ["data.micro_batch_size=4", "parallel.dp_mode=fsdp", "parallel.compile=true"]),
    "pp2-compile": (2, ["data.micro_batch_size=4", "train.grad_accum=2", "parallel.pp=2", "parallel.compile=true"]),
}


@pytest.fixture(scope="module")
def single_run(synth_data, tmp_path_factory):
    return shared_once(tmp_path_factory, "grid-single", lambda run: run_train(
        run, synth_data, *COMMON, f"data.micro_batch_size={GLOBAL_BATCH}"))


_loaded: dict[tuple, dict[str, torch.Tensor]] = {}


def final_weights(run: str, step: int, use_ema: bool = False) -> dict[str, torch.Tensor]:
    """Cached: the reference runs are compared with every layout (each run has its own directory)."""
    from pipelines.text2image.spec import SPEC
    key = (run, step, use_ema)
    if key not in _loaded:
        _loaded[key] = conftest_final_weights(SPEC, run, step, use_ema)
    return _loaded[key]


def assert_same_weights(ref_run: str, run: str, step: int) -> None:
    """The final weights and the final EMA weights of `run` equal those of `ref_run`."""
    for use_ema in (False, True):
        ref_w, par_w = final_weights(ref_run, step, use_ema), final_weights(run, step, use_ema)
        assert ref_w.keys() == par_w.keys()
        for name in ref_w:
            torch.testing.assert_close(par_w[name], ref_w[name], rtol=1e-5, atol=1e-6,
                                       msg=f"{'EMA ' if use_ema else ''}{name}")


@pytest.fixture(scope="module")
def ema_is_distinct():
    """Checks once per reference run that its EMA weights differ from its weights (else comparing
    EMA would prove nothing)."""
    checked = set()

    def check(run: str, step: int) -> None:
        if run not in checked:
            w, ema = final_weights(run, step), final_weights(run, step, use_ema=True)
            gap = max((w[n] - ema[n]).abs().max().item() for n in w)
            assert gap > 1e-5, f"EMA within {gap} of the weights"
            checked.add(run)
    return check


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(single_run, synth_data, tmp_path, layout, ema_is_distinct):
    nproc, overrides = LAYOUTS[layout]
    run = str(tmp_path / "run")
    run_train(run, synth_data, *COMMON, *overrides, nproc=nproc)
    assert_same_training(single_run, run, range(1, STEPS + 1))
    ema_is_distinct(single_run, STEPS)
    assert_same_weights(single_run, run, STEPS)


RESUME_STEPS = 6
RESUME_COMMON = [f"train.steps={RESUME_STEPS}", "train.log_every=1", "train.ckpt_every=3", "train.sample_every=0",
                 "sample.num=0", "train.ema_decay=0.9", "model.depth=4"]


@pytest.fixture(scope="module")
def uninterrupted(synth_data, tmp_path_factory):
    return shared_once(tmp_path_factory, "grid-whole", lambda run: run_train(
        run, synth_data, *RESUME_COMMON, f"data.micro_batch_size={GLOBAL_BATCH}"))


@pytest.fixture(scope="module")
def fsdp_checkpoint(synth_data, tmp_path_factory):
    """Steps 1-3 under FSDP over 2 ranks, then 'killed' right after the step-3 checkpoint."""
    return shared_once(tmp_path_factory, "grid-fsdp-killed", lambda run: run_train(
        run, synth_data, *RESUME_COMMON, "train.stop_after=4", "data.micro_batch_size=4", "parallel.dp_mode=fsdp",
        nproc=2))


@pytest.mark.parametrize("layout", ["single", "tp2", "fsdp4", "pp2"])
def test_checkpoint_resumes_under_another_layout(uninterrupted, fsdp_checkpoint, synth_data, tmp_path, layout,
                                                ema_is_distinct):
    import shutil
    nproc, overrides = {"single": (1, ["data.micro_batch_size=8"]),
                        "tp2": (2, ["data.micro_batch_size=8", "parallel.tp=2"]),
                        "fsdp4": (4, ["data.micro_batch_size=2", "parallel.dp_mode=fsdp"]),
                        "pp2": (2, ["data.micro_batch_size=4", "train.grad_accum=2", "parallel.pp=2"])}[layout]
    run = str(tmp_path / "run")
    shutil.copytree(fsdp_checkpoint, run)
    run_train(run, synth_data, *RESUME_COMMON, "run.resume=auto", *overrides, nproc=nproc)
    # The resumed part (steps 4-6) continues as if the FSDP run had never stopped.
    assert_same_training(uninterrupted, run, range(4, RESUME_STEPS + 1))
    ema_is_distinct(uninterrupted, RESUME_STEPS)
    assert_same_weights(uninterrupted, run, RESUME_STEPS)  # the EMA too: saved under FSDP, resharded


def test_checkpoint_chain_across_compositions(uninterrupted, synth_data, tmp_path):
    """PP2 x FSDP2 (steps 1-2) -> FSDP4 (steps 3-4) -> PP2 x TP2 (steps 5-6), each run 'killed'
    one step after its checkpoint: every hand-over reshards through DCP and the loader's sample
    position, and the chain trains exactly as the uninterrupted single process."""
    run = str(tmp_path / "run")
    chain = [(["train.stop_after=3", "data.micro_batch_size=2", "train.grad_accum=2", "parallel.pp=2",
               "parallel.dp_shard=2"]),
             (["train.stop_after=5", "run.resume=auto", "data.micro_batch_size=2", "parallel.dp_mode=fsdp"]),
             (["run.resume=auto", "data.micro_batch_size=4", "train.grad_accum=2", "parallel.pp=2",
               "parallel.tp=2"])]
    for overrides in chain:
        run_train(run, synth_data, *RESUME_COMMON, "train.ckpt_every=2", *overrides, nproc=4)
    with open(os.path.join(run, "metrics.jsonl")) as f:
        resumed_at = [rec["step"] for rec in map(json.loads, f) if rec.get("event") == "resume"]
    assert resumed_at == [2, 4], resumed_at
    assert_same_training(uninterrupted, run, range(1, RESUME_STEPS + 1))
    assert_same_weights(uninterrupted, run, RESUME_STEPS)
