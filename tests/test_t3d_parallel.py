"""text23d under data and context parallelism trains the same model as one process (DESIGN: the
correctness rule): FSDP2 and CP2 (Ulysses, ring) over the point tokens for the point flow, FSDP2
for the shape VAE; a checkpoint written under one layout resumes under another as if uninterrupted.
Each run: 5 steps, global batch 8, gloo, fp32; loss and grad norm per step at rtol 1e-5, final
weights (gathered by DCP into one process) at rtol 1e-5."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_same_training, shared_once
from tests.conftest import final_weights as conftest_final_weights
from tests.test_t3d_train import run_t3d

pytestmark = [pytest.mark.slow, pytest.mark.dist]

STEPS = 5
COMMON = [f"train.steps={STEPS}", "train.ckpt_every=100", "train.sample_every=0", "sample.num=0",
          "train.ema_decay=0.9"]
LAYOUTS = {  # name: (stage config, processes, overrides); micro batch x dp = 8
    "points-fsdp2": ("tiny_points.yaml", 2, ["data.micro_batch_size=4", "parallel.dp_mode=fsdp"]),
    "points-cp2-ulysses": ("tiny_points.yaml", 2, ["data.micro_batch_size=8", "parallel.cp=2",
                                                   "parallel.cp_mode=ulysses"]),
    "points-cp2-ring": ("tiny_points.yaml", 2, ["data.micro_batch_size=8", "parallel.cp=2", "parallel.cp_mode=ring"]),
    "vae-fsdp2": ("tiny_vae.yaml", 2, ["data.micro_batch_size=4", "parallel.dp_mode=fsdp"]),
}


@pytest.fixture(scope="module")
def single_runs(synth3d_data, tmp_path_factory):
    out = {}
    for config in ("tiny_points.yaml", "tiny_vae.yaml"):
        out[config] = shared_once(tmp_path_factory, "t3d-single-" + config.split(".")[0], lambda run: run_t3d(
            config, run, synth3d_data, *COMMON, "data.micro_batch_size=8"))
    return out


def assert_same_weights(ref_run: str, run: str) -> None:
    from pipelines.text23d.spec import SPEC
    ref, par = conftest_final_weights(SPEC, ref_run, STEPS), conftest_final_weights(SPEC, run, STEPS)
    assert ref.keys() == par.keys()
    for name in ref:
        torch.testing.assert_close(par[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(single_runs, synth3d_data, tmp_path, layout):
    config, nproc, overrides = LAYOUTS[layout]
    run = str(tmp_path / "run")
    run_t3d(config, run, synth3d_data, *COMMON, *overrides, nproc=nproc)
    assert_same_training(single_runs[config], run, range(1, STEPS + 1))
    assert_same_weights(single_runs[config], run)


def test_checkpoint_resumes_under_another_layout(single_runs, synth3d_data, tmp_path):
    """FSDP2 for 3 steps -> CP2 (ring) for the rest: the same losses and weights as one process."""
    run = str(tmp_path / "run")
    base = [s for s in COMMON if not s.startswith("train.ckpt_every")] + ["train.ckpt_every=3"]
    run_t3d("tiny_points.yaml", run, synth3d_data, *base, "data.micro_batch_size=4", "parallel.dp_mode=fsdp",
            "train.stop_after=3", nproc=2)
    run_t3d("tiny_points.yaml", run, synth3d_data, *base, "data.micro_batch_size=8", "parallel.cp=2",
            "parallel.cp_mode=ring", nproc=2)
    assert_same_training(single_runs["tiny_points.yaml"], run, range(1, STEPS + 1))
    assert_same_weights(single_runs["tiny_points.yaml"], run)
