"""The precision policy is applied the same way in every layout (DESIGN: device and precision policy).

Each layout builds the real text2image DiT through its spec, wraps it in the Trainer and runs
one optimizer step's forward and backward with precision.compute=bf16 (what CUDA runs use; forced
here on CPU, tiny sizes). Hooks on every linear layer of the DiT blocks record the dtype of its
output (the matmul's) and of the gradient flowing back into it (the residual stream may stay fp32
under autocast; the matmuls may not); afterwards every parameter's gradient must be fp32 (master
weights), and under FSDP the gradient reduce-scatter must carry fp32 (reduce dtype). The fp32
policy is the control: the same hooks see fp32 activations there, so a policy that is silently
not applied fails.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.dist_harness import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "pipelines", "text2image", "configs", "tiny.yaml")
SMALL = ["model.hidden=32", "model.depth=2", "model.heads=2", "text.width=32", "text.layers=1", "text.heads=2",
         "text.context_length=8", "train.ema_decay=0", "sample.num=0"]

# layout: (ranks, overrides)
LAYOUTS = {
    "single": (1, []),
    "ddp": (2, ["parallel.dp_mode=ddp"]),
    "fsdp": (2, ["parallel.dp_mode=fsdp"]),
    "tp2": (2, ["parallel.tp=2", "parallel.dp_mode=none"]),
    "pp2": (2, ["parallel.pp=2", "parallel.dp_mode=none", "train.grad_accum=2"]),
}


def _one_step(rank, world_size, run_dir, overrides):
    import torch.distributed as dist

    from common.config import build_config
    from common.dist import DistInfo
    from common.nn.dit_block import DiTBlock
    from common.precision import resolve_policy
    from common.trainer import Trainer
    from pipelines.text2image import components
    from pipelines.text2image.config import T2IConfig
    from pipelines.text2image.spec import SPEC

    cfg = build_config(T2IConfig, TINY, [*SMALL, f"run.dir={run_dir}", "data.micro_batch_size=2", *overrides])
    torch.manual_seed(0)
    comp = components.build(cfg)
    prepare, criterion = components.make_step_fns(comp, torch.device("cpu"))
    info = DistInfo(rank, world_size, rank, torch.device("cpu"), resolve_policy(cfg.precision, torch.device("cpu")))
    pm = SPEC.parallelize(comp.model, cfg.parallel, info, microbatches=cfg.train.grad_accum, criterion=criterion,
                          name=SPEC.name)
    seen = {"act": set(), "act_grad": set(), "reduce": set()}

    def record(module, args, out):
        seen["act"].add(str(out.dtype))
        if out.requires_grad:
            out.register_hook(lambda g: seen["act_grad"].add(str(g.dtype)))

    blocks = [m for m in pm.module.modules() if isinstance(m, DiTBlock)]
    assert blocks, "no DiT block on this rank"
    for linear in (m for b in blocks for m in b.modules() if isinstance(m, torch.nn.Linear)):
        linear.register_forward_hook(record)
    # FSDP2's gradient reduce-scatter (dist.reduce_scatter_single in this torch)
    reduce_scatter = dist.reduce_scatter_single

    def recording_reduce_scatter(*a, **kw):
        seen["reduce"].add(str(kw["input"].dtype))
        return reduce_scatter(*a, **kw)

    dist.reduce_scatter_single = recording_reduce_scatter
    try:
        trainer = Trainer(cfg, info, pm, prepare, criterion, loader=None, signature={})
        gen = torch.Generator().manual_seed(1)
        batches = [{"image": torch.rand(2, 3, 32, 32, generator=gen) * 2 - 1, "caption": ["a red cube", "a blue ball"],
                    "__position__": torch.tensor([4 * i + 2 * rank, 4 * i + 2 * rank + 1])}
                   for i in range(cfg.train.grad_accum)]
        loss, *_ = trainer._forward_backward(iter(batches))
    finally:
        dist.reduce_scatter_single = reduce_scatter
    grads = {str(p.grad.dtype) for p in pm.module.parameters() if p.grad is not None}
    params = {str(p.dtype) for p in pm.module.parameters()}
    return {k: sorted(v) for k, v in seen.items()} | {"grad": sorted(grads), "param": sorted(params), "loss": loss}


def _run(layout: str, compute: str, tmp_path) -> list[dict]:
    ranks, overrides = LAYOUTS[layout]
    args = (str(tmp_path / "run"), [*overrides, f"precision.compute={compute}"])
    return run_ranks(_one_step, world_size=ranks, args=args, timeout=240)


@pytest.mark.dist
@pytest.mark.parametrize("layout", [pytest.param(name, marks=[] if name == "single" else [pytest.mark.slow])
                                    for name in LAYOUTS])
def test_bf16_policy_applied_in_every_layout(layout, tmp_path):
    results = _run(layout, "bf16", tmp_path)
    for rank, r in enumerate(results):
        assert r["act"] == ["torch.bfloat16"], (rank, r)
        assert r["act_grad"] == ["torch.bfloat16"], (rank, r)
        assert r["param"] == ["torch.float32"] and r["grad"] == ["torch.float32"], (rank, r)  # fp32 master weights
        if layout == "fsdp":
            assert r["reduce"] == ["torch.float32"], (rank, r)
        assert r["loss"] == r["loss"]  # finite enough to compare: NaN != NaN


@pytest.mark.dist
@pytest.mark.parametrize("layout", ["single", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_fp32_policy_is_the_control(layout, tmp_path):
    for r in _run(layout, "fp32", tmp_path):
        assert r["act"] == ["torch.float32"] and r["act_grad"] == ["torch.float32"], r
        assert r["grad"] == ["torch.float32"]
