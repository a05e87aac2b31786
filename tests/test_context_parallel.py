"""Context parallelism (Ulysses, ring, hybrid) on gloo ranks against full single-process attention.

Every rank builds the same full q, k, v (seeded), shards them, runs CP attention, gathers, and
backpropagates a random-weighted sum of the output. Values are compared on every rank; input
gradients are averaged over the CP group first (gather's backward is N x the local slice, meant
for a CP-averaged reduction; see ContextParallel.gather). float64 cases are held to 1e-10, the fp32
cases to rtol 1e-5 / atol 1e-6; the reference is plain single-process softmax attention written
here, so this file does not depend on the kernel module it calls.

One 4-rank spawn runs every case (start-up dominates the runtime; cp=2 cases run on the cp dim of
a dp 2 x cp 2 mesh); the per-case tests then read the cached results.
"""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_ranks

pytestmark = pytest.mark.dist

B, D = 2, 8
TOL64 = 1e-10

# name -> (mode, layout, causal, Hq, Hkv, L, dtype, mesh). mesh: "cp2" = the cp dim of a (dp 2, cp 2)
# mesh (two CP groups run side by side), "cp4" = 1-D over the 4 ranks (hybrid builds its sub-groups),
# "2d" = (cp_ring 2, cp_ulysses 2).
CASES = {
    "ulysses": ("ulysses", "contiguous", False, 4, 4, 16, torch.float64, "cp2"),
    "ulysses-causal": ("ulysses", "contiguous", True, 4, 4, 16, torch.float64, "cp2"),
    "ulysses-causal-zigzag": ("ulysses", "zigzag", True, 4, 4, 16, torch.float64, "cp2"),
    "ulysses-gqa": ("ulysses", "contiguous", True, 4, 2, 16, torch.float64, "cp2"),
    "ulysses-gqa-replicated-kv": ("ulysses", "zigzag", True, 4, 1, 16, torch.float64, "cp2"),
    "ulysses-pad-causal-zigzag": ("ulysses", "zigzag", True, 4, 4, 13, torch.float64, "cp2"),
    "ulysses-pad": ("ulysses", "contiguous", False, 4, 4, 11, torch.float64, "cp2"),
    "ulysses-fp32": ("ulysses", "contiguous", True, 4, 2, 16, torch.float32, "cp2"),
    "ring": ("ring", "contiguous", False, 4, 4, 16, torch.float64, "cp2"),
    "ring-causal": ("ring", "contiguous", True, 4, 4, 16, torch.float64, "cp2"),
    "ring-causal-zigzag": ("ring", "zigzag", True, 4, 4, 16, torch.float64, "cp2"),
    "ring-gqa": ("ring", "contiguous", False, 4, 2, 16, torch.float64, "cp2"),
    "ring-gqa-causal-zigzag": ("ring", "zigzag", True, 4, 2, 16, torch.float64, "cp2"),
    "ring-pad-causal-zigzag": ("ring", "zigzag", True, 4, 4, 13, torch.float64, "cp2"),
    "ring-fp32-causal-zigzag": ("ring", "zigzag", True, 4, 2, 16, torch.float32, "cp2"),
    "ring4": ("ring", "contiguous", False, 4, 4, 16, torch.float64, "cp4"),
    "ring4-causal": ("ring", "contiguous", True, 4, 4, 16, torch.float64, "cp4"),
    "ring4-causal-zigzag": ("ring", "zigzag", True, 4, 4, 16, torch.float64, "cp4"),
    "ring4-gqa-pad-causal-zigzag": ("ring", "zigzag", True, 4, 2, 21, torch.float64, "cp4"),
    "ring4-pad": ("ring", "contiguous", False, 4, 4, 10, torch.float64, "cp4"),
    "ring4-mostly-padding-causal": ("ring", "contiguous", True, 4, 4, 3, torch.float64, "cp4"),  # rank 3: padding only
    "ulysses4-gqa-replicated-kv": ("ulysses", "zigzag", True, 4, 2, 16, torch.float64, "cp4"),
    "hybrid2x2": ("hybrid", "contiguous", False, 4, 4, 16, torch.float64, "2d"),
    "hybrid2x2-causal": ("hybrid", "contiguous", True, 4, 4, 16, torch.float64, "cp4"),
    "hybrid2x2-causal-zigzag": ("hybrid", "zigzag", True, 4, 4, 16, torch.float64, "2d"),
    "hybrid2x2-gqa-pad-causal-zigzag": ("hybrid", "zigzag", True, 4, 2, 19, torch.float64, "cp4"),
    "hybrid2x2-mostly-padding-zigzag": ("hybrid", "zigzag", False, 4, 4, 3, torch.float64, "2d"),
    "hybrid2x2-fp32-causal-zigzag": ("hybrid", "zigzag", True, 4, 2, 16, torch.float32, "2d"),
}


def _meshes():
    from torch.distributed.device_mesh import init_device_mesh
    return {"cp2": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))["cp"],
            "cp4": init_device_mesh("cpu", (4,), mesh_dim_names=("cp",)),
            "2d": init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp_ring", "cp_ulysses"))}


def _full_attention(q, k, v, causal):
    """Independent ground truth: plain softmax attention in q's dtype, GQA by repetition."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        L = q.shape[2]
        s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _run_case(spec, meshes, seed):
    import torch.distributed as dist

    from common.parallel.context_parallel import ContextParallel

    mode, layout, causal, hq, hkv, L, dtype, mesh_kind = spec
    mesh = meshes[mesh_kind]
    cp = ContextParallel(mesh, mode, layout=layout, ulysses_degree=2 if mode == "hybrid" and mesh.ndim == 1 else None)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, hq, L, D, generator=g, dtype=dtype)
    k = torch.randn(B, hkv, L, D, generator=g, dtype=dtype)
    v = torch.randn(B, hkv, L, D, generator=g, dtype=dtype)
    w = torch.randn(B, hq, L, D, generator=g, dtype=dtype)

    rq, rk, rv = (t.clone().requires_grad_() for t in (q, k, v))
    ref, ref_lse = _full_attention(rq, rk, rv, causal)
    (ref * w).sum().backward()

    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    qs, ks, vs = cp.shard(q, 2), cp.shard(k, 2), cp.shard(v, 2)
    out_l, lse_l = cp.attention(qs, ks, vs, causal=causal, return_lse=True)
    out = cp.gather(out_l, 2)
    lse = cp.gather(lse_l, 2)
    (out * w).sum().backward()
    group = mesh.get_group() if mesh.ndim == 1 else dist.group.WORLD  # 2d: the world is the CP group
    grads = []
    for t in (q, k, v):
        gr = t.grad.clone()
        dist.all_reduce(gr, group=group)
        grads.append(gr / cp.size)
    errs = {"out": (out - ref).abs().max().item(), "lse": (lse - ref_lse.float()).abs().max().item()}
    errs["ref_max"] = max(ref.abs().max().item(), *(t.grad.abs().max().item() for t in (rq, rk, rv)))
    for name, gr, rt in zip("qkv", grads, (rq, rk, rv)):
        errs["d" + name] = (gr - rt.grad).abs().max().item()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-6)
        for gr, rt in zip(grads, (rq, rk, rv)):
            torch.testing.assert_close(gr, rt.grad, rtol=1e-5, atol=1e-6)
    errs["finite"] = bool(torch.isfinite(out_l).all() and all(torch.isfinite(x).all() for x in grads))
    return errs


def _shard_gather_checks(cp):
    """Round trip, positions, and gather's gradient (N x the local slice of the incoming one)."""
    res = {}
    for L in (16, 13):
        x = torch.randn(3, L, 5, generator=torch.Generator().manual_seed(L), dtype=torch.float64, requires_grad=True)
        s = cp.shard(x, 1)
        pos = cp.positions(L)
        real = pos < L
        res[f"positions-{L}"] = (s.shape[1] == len(pos) and torch.equal(s.detach()[:, real], x.detach()[:, pos[real]])
                                 and bool((s.detach()[:, ~real] == 0).all()))
        y = cp.gather(s * 2, 1)
        res[f"roundtrip-{L}"] = torch.equal(y.detach(), 2 * x.detach())
        wgt = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        (y * wgt).sum().backward()
        expect = torch.zeros_like(x)
        expect[:, pos[real]] = cp.size * 2 * wgt[:, pos[real]]
        res[f"gather-grad-{L}"] = torch.equal(x.grad, expect)
    return res


def _refusal(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _refusals(meshes):
    from common.parallel.context_parallel import ContextParallel
    uly2, uly4 = ContextParallel(meshes["cp2"], "ulysses"), ContextParallel(meshes["cp4"], "ulysses")
    hybrid = ContextParallel(meshes["cp4"], "hybrid", ulysses_degree=2)
    x3, x4 = torch.randn(1, 3, 4, D), torch.randn(1, 4, 4, D)
    return {
        "heads": _refusal(lambda: uly2.validate(3, 1, 16)),
        "heads-attention": _refusal(lambda: uly2.attention(x3, x3, x3)),
        "heads4": _refusal(lambda: uly4.validate(6, 2, 16)),
        "hybrid-heads": _refusal(lambda: hybrid.validate(5, 5, 16)),
        "gqa": _refusal(lambda: uly2.validate(4, 3, 16)),
        "mask": _refusal(lambda: uly2.attention(x4, x4, x4, attn_mask=torch.ones(4, 8, dtype=torch.bool))),
        "stale-length": _refusal(lambda: uly2.attention(x4, x4, x4, seq_len=5)),
    }


def _worker(rank, world_size):
    import time

    from common.parallel.context_parallel import ContextParallel
    meshes = _meshes()
    out = {}
    for i, (name, spec) in enumerate(CASES.items()):
        t0 = time.perf_counter()
        out[name] = _run_case(spec, meshes, seed=i)
        out[name]["seconds"] = time.perf_counter() - t0
    for m in ("cp2", "cp4"):
        for layout in ("contiguous", "zigzag"):
            out[f"shard-{m}-{layout}"] = _shard_gather_checks(ContextParallel(meshes[m], "ring", layout=layout))
    out["refusals"] = _refusals(meshes)
    return out


@pytest.fixture(scope="module")
def results():
    # One 4-rank launch for everything: process start-up dominates, the cases take milliseconds.
    return run_ranks(_worker, 4)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_full_attention(results, name):
    errs = {key: max(r[name][key] for r in results) for key in ("out", "lse", "dq", "dk", "dv")}
    assert all(r[name]["finite"] for r in results)
    ref_max = max(r[name]["ref_max"] for r in results)
    # fp32: assert_close (rtol 1e-5, atol 1e-6, elementwise) already ran on the ranks; this is its
    # max-norm form
    tol = TOL64 if CASES[name][6] == torch.float64 else 1e-6 + 1e-5 * ref_max
    assert errs["lse"] < 1e-5, (name, errs)  # lse comes back as fp32 (kernels.attention's contract)
    assert max(errs["out"], errs["dq"], errs["dk"], errs["dv"]) < tol, (name, errs)
    print(name, {k: f"{v:.1e}" for k, v in errs.items()})


@pytest.mark.parametrize("mesh", ["cp2", "cp4"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_shard_gather(results, mesh, layout):
    for r in results:
        assert all(r[f"shard-{mesh}-{layout}"].values()), r[f"shard-{mesh}-{layout}"]


def test_refusals(results):
    m = results[0]["refusals"]
    assert "parallel.cp=2 (ulysses 2 x ring 1): 3 heads are not divisible by the Ulysses degree 2" in m["heads"]
    assert "3 heads are not divisible by the Ulysses degree 2" in m["heads-attention"]
    assert "6 heads are not divisible by the Ulysses degree 4" in m["heads4"]
    assert "parallel.cp=4 (ulysses 2 x ring 2): 5 heads are not divisible by the Ulysses degree 2" in m["hybrid-heads"]
    assert "4 query heads are not a multiple of 3 kv heads" in m["gqa"]
    assert "attn_mask is not supported" in m["mask"]
    assert "sequence length 5" in m["stale-length"]


def test_single_rank_is_plain_attention():
    from common.kernels import attention
    from common.parallel.context_parallel import ContextParallel
    cp = ContextParallel(None)
    q = torch.randn(1, 2, 5, D)
    assert cp.shard(q, 2) is q and cp.gather(q, 2) is q
    assert torch.equal(cp.attention(q, q, q, causal=True), attention(q, q, q, causal=True))
