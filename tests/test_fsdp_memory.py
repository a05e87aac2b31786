"""FSDP2 memory: each of N ranks holds 1/N of the parameter + gradient + AdamW-state bytes.

Each rank builds the same seeded DiT, applies `apply_fsdp` (every block a unit, then the root)
over a dp_shard=N mesh, runs one forward/backward/AdamW step and counts what it holds, in two
ways, against the same counts of an unsharded single-process model after the same step:

* logical bytes: numel x element size of the local shards (`to_local()`) of every parameter,
  gradient and optimizer-state tensor (exp_avg, exp_avg_sq; the scalar `step` is skipped);
* allocated bytes: the sizes of the distinct storages behind those tensors. FSDP2 keeps each
  sharded parameter in a padded buffer and writes the reduce-scattered gradients into one padded
  flat buffer per unit (the local shards are views into both), so this includes the padding.

Padding, exactly: FSDP2 shards dim 0 of a tensor with d0 rows like torch.chunk: chunks of
c = ceil(d0 / N) rows, rank r holding rows(r) = clamp(d0 - r*c, 0, c) of them (a rank may hold
none). Writing R for one row's bytes and k for the number of copies (4: parameter, gradient,
exp_avg, exp_avg_sq):
  logical, rank r   = sum_t k * rows_t(r) * R_t                   (asserted exactly)
                   <= single / N + sum_t k * (N*c_t - d0_t) / N * R_t       ("pad share")
  logical, all ranks = single                                       (asserted exactly)
  allocated, rank r <= single / N + pad_bound,  pad_bound = sum_t k * (N*c_t - d0_t) * R_t
  allocated, all ranks in [single, single + pad_bound]
The model has tensors whose first dim does not divide by N (mlp 170 rows, final layer 27 rows,
adaLN tables of 6 and 2 rows), so the padding and the empty-shard case are exercised.
"""
from __future__ import annotations

import math

import pytest
import torch

from dist_harness import run_ranks

pytestmark = pytest.mark.dist

KINDS = ("param", "grad", "exp_avg", "exp_avg_sq")


def _model():
    from pipelines.text2image.model import DiT, dit_config
    torch.manual_seed(0)
    # 15 px / patch 3 = 25 tokens; mlp_ratio gives 170 hidden units (not a multiple of 4).
    return DiT(dit_config("tiny", img_size=15, patch_size=3, in_channels=3, hidden=64, depth=2, heads=4,
                          mlp_ratio=170 / 64, text_dim=32))


def _step(model) -> torch.optim.Optimizer:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 15, 15, generator=g)
    t = torch.rand(2, generator=g)
    ctx = torch.randn(2, 8, 32, generator=g)
    mask = torch.ones(2, 8, dtype=torch.bool)
    target = torch.randn(2, 3, 15, 15, generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    torch.nn.functional.mse_loss(model(x, t, ctx, mask), target).backward()
    opt.step()
    return opt


def _local(t):
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def _count(model, opt) -> dict:
    """Logical bytes per kind and the allocated bytes of the distinct storages behind them."""
    tensors = {k: [] for k in KINDS}
    for p in model.parameters():
        tensors["param"].append(_local(p))
        if p.grad is not None:
            tensors["grad"].append(_local(p.grad))
        state = opt.state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq"):
            if k in state:
                tensors[k].append(_local(state[k]))
    logical = {k: sum(t.numel() * t.element_size() for t in ts) for k, ts in tensors.items()}
    storages = {}
    for ts in tensors.values():
        for t in ts:
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return {"logical": logical, "logical_total": sum(logical.values()),
            "allocated_total": sum(storages.values())}


def _rank(rank, world_size):
    from common.config import ParallelConfig
    from common.parallel.data_parallel import apply_fsdp
    from common.parallel.dims import ParallelDims
    dims = ParallelDims.from_config(ParallelConfig(dp_mode="fsdp", dp_shard=world_size), world_size)
    mesh = dims.build_mesh("cpu")
    model = _model()
    apply_fsdp(model, list(model.blocks), mesh, dims)
    opt = _step(model)
    return _count(model, opt)


def _expected(shapes: list[tuple[tuple[int, ...], int]], n: int) -> dict:
    """Exact per-rank logical bytes and the padding terms from the (shape, element size) list."""
    k = len(KINDS)
    per_rank = [0] * n
    pad_bound = 0
    for shape, esize in shapes:
        d0 = shape[0]
        row = math.prod(shape[1:]) * esize
        c = -(-d0 // n)
        for r in range(n):
            per_rank[r] += k * max(0, min(c, d0 - r * c)) * row
        pad_bound += k * (n * c - d0) * row
    return {"per_rank": per_rank, "pad_bound": pad_bound}


@pytest.fixture(scope="module")
def single():
    model = _model()
    opt = _step(model)
    counts = _count(model, opt)
    shapes = [(tuple(p.shape), p.element_size()) for p in model.parameters()]
    assert all(len(s) >= 1 for s, _ in shapes), "FSDP2 shards dim 0: scalars would need their own rule"
    return counts, shapes


@pytest.mark.parametrize("n", [2, 4])
def test_fsdp_shards_params_grads_optimizer_state(single, n):
    ref, shapes = single
    s = ref["logical_total"]
    assert ref["allocated_total"] == s  # unsharded: one storage per tensor, no padding
    assert all(v == ref["logical"]["param"] for v in ref["logical"].values())  # every parameter trained

    results = run_ranks(_rank, n, timeout=120)
    exp = _expected(shapes, n)
    pad_share = exp["pad_bound"] / n
    print(f"\nFSDP N={n}: single-process {s} B (param+grad+exp_avg+exp_avg_sq); "
          f"single/N = {s / n:.0f} B; pad_bound = {exp['pad_bound']} B")
    for r, res in enumerate(results):
        print(f"  rank {r}: logical {res['logical_total']} B {res['logical']}, allocated {res['allocated_total']} B")
    for r, res in enumerate(results):
        assert res["logical_total"] == exp["per_rank"][r], (r, res, exp)
        assert res["logical_total"] <= s / n + pad_share
        for kind in KINDS:  # each kind is itself a 1/N share
            assert res["logical"][kind] <= ref["logical"][kind] / n + pad_share / len(KINDS)
        assert res["allocated_total"] <= s / n + exp["pad_bound"]
    assert sum(r["logical_total"] for r in results) == s
    total_alloc = sum(r["allocated_total"] for r in results)
    assert s <= total_alloc <= s + exp["pad_bound"]
    print(f"  sum over ranks: logical {sum(r['logical_total'] for r in results)} B, allocated {total_alloc} B "
          f"(= single + {total_alloc - s} B padding)")


def _adamw_rank(rank, world_size, steps):
    """build_optimizer over FSDP-sharded parameters: the fused kernel, run on the local shards;
    the full parameters after `steps` steps of fixed gradients."""
    from common.config import OptimConfig, ParallelConfig
    from common.optim import build_optimizer
    from common.parallel.data_parallel import apply_fsdp
    from common.parallel.dims import ParallelDims
    dims = ParallelDims.from_config(ParallelConfig(dp_mode="fsdp", dp_shard=world_size), world_size)
    model = _model()
    apply_fsdp(model, list(model.blocks), dims.build_mesh("cpu"), dims)
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1))
    kinds = [(g["fused"], g["foreach"]) for g in opt.param_groups]
    _fixed_grad_steps(model, opt, steps)
    # numpy: pickled by value (a tensor would cross the queue as shared memory of an exiting process)
    return kinds, {n: p.detach().full_tensor().numpy() for n, p in model.named_parameters()}


def _fixed_grad_steps(model, opt, steps):
    for s in range(steps):
        g = torch.Generator().manual_seed(100 + s)
        for p in model.parameters():  # the same full gradient on every rank, then this rank's shard
            full = torch.randn(p.shape, generator=g)
            p.grad = torch.distributed.tensor.distribute_tensor(full, p.device_mesh, p.placements) \
                if isinstance(p, torch.distributed.tensor.DTensor) else full
        opt.step()


def test_fsdp_parameters_take_the_fused_adamw_with_the_single_process_result():
    from common.config import OptimConfig
    from common.optim import build_optimizer
    model = _model()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1))
    _fixed_grad_steps(model, opt, 3)
    [(kinds, sharded), _] = run_ranks(_adamw_rank, 2, args=(3,), timeout=120)
    assert kinds == [(True, None), (True, None)]
    for n, p in model.named_parameters():
        torch.testing.assert_close(torch.from_numpy(sharded[n]), p.detach(), rtol=1e-6, atol=1e-7, msg=n)
        assert not torch.equal(p, start[n]), n
