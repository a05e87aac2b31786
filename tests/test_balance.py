"""balanced_apply: evening out per-item work (ViT tiles) across a DP group.

Pure tests of the plan (coverage, order, shares within one item, minimal movement), then gloo runs
on 2 and 3 processes against a single-process reference in float64: outputs, input gradients and
the sum over ranks of the parameter gradients match fn run without balancing; ranks with zero items
(and zero-size shares) still run fn and get zero, not missing, parameter gradients.
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn

from common.parallel.balance import balanced_apply, imbalance, moved, plan, shares
from tests.dist_harness import run_ranks

ATOL = 1e-12


# ----------------------------------------------------------------------------- pure functions
def _check_plan(counts):
    p = plan(counts)
    share = shares(counts)
    assert len(p) == len(counts)
    assert max(share) - min(share) <= 1 and sum(share) == sum(counts)
    seen = []
    for dst, slices in enumerate(p):
        assert sum(stop - start for _, start, stop in slices) == share[dst]
        assert slices == sorted(slices), "a share is ordered by (source rank, index)"
        for src, start, stop in slices:
            assert 0 <= start < stop <= counts[src]
            seen += [(src, i) for i in range(start, stop)]
        own = [s for s in slices if s[0] == dst]
        assert own == ([(dst, 0, min(counts[dst], share[dst]))] if min(counts[dst], share[dst]) else [])
    assert sorted(seen) == [(r, i) for r, c in enumerate(counts) for i in range(c)], "every item exactly once"
    assert moved(counts) == sum(max(0, c - s) for c, s in zip(counts, share))
    # no assignment of the extras can move fewer items than giving them to the fullest ranks
    base, extra = divmod(sum(counts), len(counts))
    best = sum(max(0, c - base) for c in counts) - sum(1 for c in sorted(counts, reverse=True)[:extra] if c > base)
    assert moved(counts) == best


@pytest.mark.parametrize("counts", [[7, 1], [0, 5, 2], [1, 0, 0], [0, 0], [3, 3, 3], [1, 9, 0, 2], [5], [0, 5, 5, 0]])
def test_plan_examples(counts):
    _check_plan(counts)


def test_plan_known_values():
    assert plan([7, 1]) == [[(0, 0, 4)], [(0, 4, 7), (1, 0, 1)]]
    assert plan([0, 5, 2]) == [[(1, 3, 5)], [(1, 0, 3)], [(2, 0, 2)]]
    assert shares([0, 5, 2]) == [2, 3, 2]  # the extra item stays on the fullest rank
    assert plan([2, 2]) == [[(0, 0, 2)], [(1, 0, 2)]] and moved([2, 2]) == 0


def test_plan_random_and_deterministic():
    rng = random.Random(0)
    for _ in range(300):
        counts = [rng.choice([0, 0, 1, 2, 5, 13]) + rng.randrange(4) for _ in range(rng.randint(1, 9))]
        _check_plan(counts)
        assert plan(list(counts)) == plan(counts)


def test_plan_rejects_negative():
    with pytest.raises(ValueError, match=">= 0"):
        plan([3, -1])


def test_imbalance():
    assert imbalance([4, 4]) == 1.0
    assert imbalance([6, 2]) == 1.5
    assert imbalance([0, 0, 0]) == 1.0
    assert imbalance(shares([7, 1])) == 1.0


def test_no_process_group_is_plain_fn():
    fn = nn.Linear(3, 2).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    assert torch.equal(balanced_apply(fn, x, None), fn(x))


# ----------------------------------------------------------------------------- distributed
class _TinyEncoder(nn.Module):
    """conv + MLP: items are independent along dim 0, as ViT tiles are."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.mlp = nn.Sequential(nn.Linear(4 * 5 * 5, 8), nn.Tanh(), nn.Linear(8, 6))

    def forward(self, x):
        return self.mlp(self.conv(x).flatten(1))


def _model():
    torch.manual_seed(0)
    return _TinyEncoder().double()


def _inputs(counts, case):
    g = torch.Generator().manual_seed(1000 * case + 1)
    xs = [torch.randn(c, 3, 5, 5, generator=g, dtype=torch.float64) for c in counts]
    ws = [torch.randn(c, 6, generator=g, dtype=torch.float64) for c in counts]
    return xs, ws


def _reference(counts, case):
    """Single process, no balancing: per-rank outputs and input grads, summed parameter grads."""
    model = _model()
    xs, ws = _inputs(counts, case)
    xs = [x.requires_grad_() for x in xs]
    outs = [model(x) for x in xs]
    sum((o * w).sum() for o, w in zip(outs, ws)).backward()
    return ([o.detach() for o in outs], [x.grad for x in xs],
            {k: p.grad.clone() for k, p in model.named_parameters()})


def _run_case(rank, counts, case, group=None):
    import torch.distributed as dist
    model = _model()
    xs, ws = _inputs(counts, case)
    r = dist.get_rank(group) if group is not None else rank
    x = xs[r].requires_grad_()
    seen = []

    def fn(t):
        seen.append(t.shape[0])
        return model(t)

    out = balanced_apply(fn, x, group)
    (out * ws[r]).sum().backward()
    # numpy, not tensors: tensors cross the result queue as shared memory that dies with the rank
    return {"out": out.detach().numpy(), "xgrad": x.grad.numpy(), "seen": seen,
            "pgrad": {k: None if p.grad is None else p.grad.numpy() for k, p in model.named_parameters()}}


def _ranks_main(rank, world_size, cases):
    import torch.distributed as dist
    res = [_run_case(rank, counts, i) for i, counts in enumerate(cases)]
    if world_size == 3:  # a subgroup: group ranks differ from global ranks
        sub = dist.new_group([1, 2])
        res.append(_run_case(rank, [3, 0], len(cases), sub) if rank in (1, 2) else None)
    return res


def _check(results, counts, case):
    results = [{k: (torch.from_numpy(v) if k in ("out", "xgrad") else v) for k, v in res.items()} for res in results]
    for res in results:
        res["pgrad"] = {k: None if g is None else torch.from_numpy(g) for k, g in res["pgrad"].items()}
    ref_out, ref_xgrad, ref_pgrad = _reference(counts, case)
    share = shares(counts)
    for r, res in enumerate(results):
        assert res["out"].shape == ref_out[r].shape
        torch.testing.assert_close(res["out"], ref_out[r], rtol=0, atol=ATOL)
        torch.testing.assert_close(res["xgrad"], ref_xgrad[r], rtol=0, atol=ATOL)
        assert res["seen"] == [share[r]], "fn runs once per rank, on its share (also when it is empty)"
        assert all(g is not None for g in res["pgrad"].values()), "every rank has parameter grads"
        if share[r] == 0:
            assert all(torch.count_nonzero(g) == 0 for g in res["pgrad"].values())
    assert max(share) - min(share) <= 1
    for k, ref in ref_pgrad.items():
        torch.testing.assert_close(sum(res["pgrad"][k] for res in results), ref, rtol=0, atol=ATOL)


CASES_2 = [[7, 1], [0, 3], [1, 0], [0, 0]]
CASES_3 = [[0, 5, 2], [1, 0, 0], [4, 4, 4]]


def test_balanced_apply_2_ranks():
    results = run_ranks(_ranks_main, 2, args=(CASES_2,), timeout=120)
    for i, counts in enumerate(CASES_2):
        _check([res[i] for res in results], counts, i)


def test_balanced_apply_3_ranks_and_subgroup():
    results = run_ranks(_ranks_main, 3, args=(CASES_3,), timeout=120)
    for i, counts in enumerate(CASES_3):
        _check([res[i] for res in results], counts, i)
    _check([results[1][-1], results[2][-1]], [3, 0], len(CASES_3))
