"""The vision-language pipeline's parallel layouts train the same model as one process (DESIGN:
the correctness rule), through the real entrypoint (pipelines.vlm.train on torchrun's rank variables, gloo, fp32).

One stage (`stages=[]`, stage.name=full: ViT + projector + Llama all train) for 3 optimizer steps,
global batch 8 in every layout, packing.loss_average=sample (the per-sample mean does not depend on
how the global batch is split into micro-batches and ranks; the per-micro-batch token mean does).
Per step, loss and gradient norm match the single-process run within rtol 1e-5; the final
checkpoint, loaded into one process (DCP gathers every shard), holds the same weights (rtol 1e-5,
atol 1e-6). The LM layouts: TP(+SP), CP (Ulysses, ring over packed varlen rows), PP (1f1b, fixed
packing.rows), FSDP x TP, where the ViT is FSDP-sharded over all 4 ranks and its tiles are
dispatched balanced over the data-parallel ranks.

A checkpoint written under FSDP (killed after step 4, so the last checkpoint is step 3) resumes
under TP, PP and one process with steps 4-6 as if the run had never stopped.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess

import pytest
import torch

from tests.conftest import ROOT, assert_same_training, run_checked, shared_once, train_cmd
from tests.conftest import final_weights as conftest_final_weights

pytestmark = [pytest.mark.slow, pytest.mark.dist]

VLM_YAML = os.path.join(ROOT, "pipelines/vlm/configs/tiny.yaml")
STEPS = 3
GLOBAL_BATCH = 8
SMALL = ["stages=[]", "stage.name=full",
         "lm.dim=64", "lm.n_layers=2", "lm.n_heads=4", "lm.n_kv_heads=2",
         "clip.width=64", "clip.layers=2", "clip.heads=2", "clip.text_width=32", "clip.text_layers=1",
         "clip.text_heads=2", "clip.embed_dim=32",
         "packing.loss_average=sample", "train.log_every=1", "sample.num=0", "train.ema_decay=0",
         "train.progress=false", "data.num_workers=0"]
COMMON = [f"train.steps={STEPS}", "train.ckpt_every=100"]

# name: (processes, overrides). Micro batch x grad_accum x dp = 8 in every layout.
LAYOUTS = {
    "tp2": (2, ["data.micro_batch_size=8", "parallel.tp=2"]),  # sequence_parallel=true (the default)
    "cp2-ulysses": (2, ["data.micro_batch_size=8", "parallel.cp=2", "parallel.cp_mode=ulysses"]),
    "cp2-ring": (2, ["data.micro_batch_size=8", "parallel.cp=2", "parallel.cp_mode=ring"]),
    "pp2": (2, ["data.micro_batch_size=4", "train.grad_accum=2", "parallel.pp=2", "parallel.pp_schedule=1f1b",
                "packing.rows=8"]),
    "fsdp2xtp2": (4, ["data.micro_batch_size=4", "parallel.dp_shard=2", "parallel.tp=2"]),
    # Compositions: FSDP inside pipeline stages (the ViT sharded on the first stage's ranks), and
    # CP x TP (ring: 1 kv head per TP rank does not split for Ulysses) with sequence parallel.
    "pp2xfsdp2": (4, ["data.micro_batch_size=2", "train.grad_accum=2", "parallel.pp=2", "parallel.dp_shard=2",
                      "parallel.pp_schedule=1f1b", "packing.rows=4"]),
    "cp2xtp2": (4, ["data.micro_batch_size=8", "parallel.cp=2", "parallel.cp_mode=ring", "parallel.tp=2"]),
}


def run_vlm(run_dir: str, data_dir: str, tokenizer: str, *overrides: str, nproc: int = 1,
            timeout: int = 600) -> subprocess.CompletedProcess:
    return run_checked(train_cmd(nproc, "pipelines.vlm.train") + [
        "--config", VLM_YAML, f"run.dir={run_dir}", f"data.train_shards={data_dir}/train",
        f"data.eval_shards={data_dir}/heldout", f"tokenizer.path={tokenizer}", *SMALL, *overrides], timeout)


@pytest.fixture(scope="module")
def tokenizer(vqa_data, tmp_path_factory):
    """One BPE for every run (the same one each run would train into its own run dir)."""
    from data.tokenizer import train_from_shards
    return os.path.join(shared_once(tmp_path_factory, "vlm-tokenizer", lambda d: train_from_shards(
        [vqa_data + "/train"], 512).save(os.path.join(d, "tokenizer"))), "tokenizer")


@pytest.fixture(scope="module")
def single_run(vqa_data, tokenizer, tmp_path_factory):
    return shared_once(tmp_path_factory, "vlm-single", lambda run: run_vlm(
        run, vqa_data, tokenizer, *COMMON, f"data.micro_batch_size={GLOBAL_BATCH}"))


def final_weights(run: str, step: int) -> dict[str, torch.Tensor]:
    from pipelines.vlm.spec import SPEC
    return conftest_final_weights(SPEC, run, step)


def assert_same_weights(ref_run: str, run: str, step: int) -> None:
    ref_w, par_w = final_weights(ref_run, step), final_weights(run, step)
    assert ref_w.keys() == par_w.keys()
    assert any(k.startswith("visual.") for k in ref_w), sorted(ref_w)[:5]
    for name in ref_w:
        torch.testing.assert_close(par_w[name], ref_w[name], rtol=1e-5, atol=1e-6, msg=name)


def vision_chunks(run: str, step: int) -> dict[str, int]:
    """{ViT parameter: number of shards it was saved in} from the DCP checkpoint's metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    md = FileSystemReader(os.path.join(run, "checkpoints", f"step_{step:08d}")).read_metadata()
    return {k: len(v.chunks) for k, v in md.state_dict_metadata.items()
            if k.startswith("model.visual.") and isinstance(v, TensorStorageMetadata)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(single_run, vqa_data, tokenizer, tmp_path, layout):
    nproc, overrides = LAYOUTS[layout]
    run = str(tmp_path / "run")
    proc = run_vlm(run, vqa_data, tokenizer, *COMMON, *overrides, nproc=nproc)
    assert_same_training(single_run, run, range(1, STEPS + 1))
    assert_same_weights(single_run, run, STEPS)
    if layout == "fsdp2xtp2":
        assert "dp_shard=2 x tp=2 (dp_mode=fsdp)" in proc.stdout, proc.stdout[-2000:]
        # The ViT has no TP plan but is FSDP-sharded over all 4 ranks (dp_shard x tp flattened):
        # every one of its tensors was saved as 4 shards.
        chunks = vision_chunks(run, STEPS)
        assert chunks and set(chunks.values()) == {4}, chunks
    if layout == "pp2xfsdp2":
        # The first stage's ViT is sharded over that stage's two data-parallel ranks.
        chunks = vision_chunks(run, STEPS)
        assert chunks and set(chunks.values()) == {2}, chunks


RESUME_STEPS = 6
RESUME_COMMON = [f"train.steps={RESUME_STEPS}", "train.ckpt_every=3"]


@pytest.fixture(scope="module")
def uninterrupted(vqa_data, tokenizer, tmp_path_factory):
    return shared_once(tmp_path_factory, "vlm-whole", lambda run: run_vlm(
        run, vqa_data, tokenizer, *RESUME_COMMON, f"data.micro_batch_size={GLOBAL_BATCH}"))


@pytest.fixture(scope="module")
def fsdp_checkpoint(vqa_data, tokenizer, tmp_path_factory):
    """Steps 1-4 under FSDP over 2 ranks, 'killed' after step 4: the last checkpoint is step 3."""
    run = shared_once(tmp_path_factory, "vlm-fsdp-killed", lambda run: run_vlm(
        run, vqa_data, tokenizer, *RESUME_COMMON, "train.stop_after=4", "data.micro_batch_size=4",
        "parallel.dp_shard=2", nproc=2))
    assert [os.path.basename(p) for p in sorted(glob.glob(os.path.join(run, "checkpoints", "step_*")))] \
        == ["step_00000003"]
    return run


@pytest.mark.parametrize("layout", ["tp2", "pp2", "single"])
def test_checkpoint_resumes_under_another_layout(uninterrupted, fsdp_checkpoint, vqa_data, tokenizer, tmp_path,
                                                 layout):
    nproc, overrides = {"tp2": (2, ["data.micro_batch_size=8", "parallel.tp=2"]),
                        "pp2": (2, ["data.micro_batch_size=4", "train.grad_accum=2", "parallel.pp=2",
                                    "packing.rows=8"]),
                        "single": (1, ["data.micro_batch_size=8"])}[layout]
    run = str(tmp_path / "run")
    shutil.copytree(fsdp_checkpoint, run)
    run_vlm(run, vqa_data, tokenizer, *RESUME_COMMON, "run.resume=auto", *overrides, nproc=nproc)
    # Steps 4-6 (re-run from the step-3 checkpoint) continue as if the FSDP run had never stopped.
    assert_same_training(uninterrupted, run, range(4, RESUME_STEPS + 1))
    assert_same_weights(uninterrupted, run, RESUME_STEPS)
