"""Context parallelism over packed variable-length rows (cu_seqlens) on gloo ranks.

Every rank builds the same packed rows: q, k, v (B, H, L, D) with cu_seqlens over the flattened
B x L tokens (segments of 1 token, long segments, zigzag chunks that cut through segments, a
padding tail as its own segment, L not a multiple of the CP chunking so CP pads). CP shards the
token dim, runs ContextParallel.attention(..., cu_seqlens=cu), gathers, and backpropagates a
random-weighted sum. The reference is the single-process varlen kernel
(common.kernels.attention with cu_seqlens_q/k) on the flattened full tensors. Input gradients are
averaged over the CP group first (gather's backward is N x the local slice; see
ContextParallel.gather). Tolerances: float64 max abs error < 1e-10 (outputs, dq, dk, dv); fp32
rtol 1e-5 / atol 1e-6 elementwise; lse (returned as fp32) < 1e-5.

A Llama end-to-end check runs a tiny float64 model on packed rows with every block's attention
under CP (tokens and per-row RoPE tables sharded by forward pre-hooks, gathered before the final
norm): logits and every parameter gradient (CP-averaged) equal the unsharded packed model's.

One 4-rank spawn runs everything (cp2 cases on the cp dim of a dp 2 x cp 2 mesh, i.e. two CP
groups side by side); the tests read the cached results.
"""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_ranks

pytestmark = pytest.mark.dist

B, D = 2, 8
TOL64 = 1e-10

# Segment lengths per row (each row sums to L; the last segment plays the padding tail).
PACKINGS = {
    13: [[1, 5, 1, 4, 2], [7, 1, 1, 3, 1]],
    16: [[16], [9, 7]],                      # one-document row: the unmasked (dense) block calls
    24: [[3, 1, 1, 8, 2, 6, 3], [1, 11, 1, 1, 4, 6]],
}


def _random_rows(L, seed):
    """B rows of random segment lengths (1 to 6 tokens, so plenty of 1-token segments) summing to L."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        row = []
        while sum(row) < L:
            row.append(min(int(torch.randint(1, 7, (), generator=g)), L - sum(row)))
        rows.append(row)
    return rows


PACKINGS[21] = _random_rows(21, seed=7)  # 21: pads to 24 under ring4 zigzag (chunks of 3)

# name -> (mode, layout, causal, Hq, Hkv, L, dtype, mesh); meshes as in test_context_parallel.py
CASES = {
    "ulysses-gqa-pad": ("ulysses", "contiguous", True, 4, 2, 13, torch.float64, "cp2"),
    "ulysses-zigzag-replicated-kv-pad": ("ulysses", "zigzag", True, 4, 1, 13, torch.float64, "cp2"),
    "ulysses-zigzag": ("ulysses", "zigzag", True, 4, 4, 24, torch.float64, "cp2"),
    "ulysses-noncausal-zigzag-pad": ("ulysses", "zigzag", False, 4, 2, 13, torch.float64, "cp2"),
    "ring-gqa-pad": ("ring", "contiguous", True, 4, 2, 13, torch.float64, "cp2"),
    "ring-zigzag-gqa-pad": ("ring", "zigzag", True, 4, 2, 13, torch.float64, "cp2"),
    "ring-zigzag": ("ring", "zigzag", True, 4, 4, 24, torch.float64, "cp2"),
    "ring-zigzag-onedoc": ("ring", "zigzag", True, 4, 2, 16, torch.float64, "cp2"),
    "ring-noncausal-pad": ("ring", "contiguous", False, 4, 2, 13, torch.float64, "cp2"),
    "ring-fp32-zigzag": ("ring", "zigzag", True, 4, 2, 24, torch.float32, "cp2"),
    "ring4-zigzag-gqa": ("ring", "zigzag", True, 4, 2, 24, torch.float64, "cp4"),
    "ring4-pad": ("ring", "contiguous", True, 4, 4, 13, torch.float64, "cp4"),
    "ring4-zigzag-random-pad": ("ring", "zigzag", True, 4, 2, 21, torch.float64, "cp4"),
    "hybrid2x2-random-pad": ("hybrid", "contiguous", True, 4, 2, 21, torch.float64, "cp4"),
    "hybrid2x2-zigzag-gqa-pad": ("hybrid", "zigzag", True, 4, 2, 13, torch.float64, "2d"),
    "hybrid2x2": ("hybrid", "contiguous", True, 4, 4, 24, torch.float64, "cp4"),
    "hybrid2x2-noncausal-zigzag": ("hybrid", "zigzag", False, 4, 4, 24, torch.float64, "2d"),
    "hybrid2x2-fp32-zigzag-pad": ("hybrid", "zigzag", True, 4, 2, 13, torch.float32, "2d"),
}

# name -> (mode, layout, L, mesh) for the Llama end-to-end check
LLAMA_CASES = {
    "llama-ring-zigzag": ("ring", "zigzag", 13, "cp2"),
    "llama-ulysses": ("ulysses", "contiguous", 13, "cp2"),
    "llama-hybrid2x2-zigzag": ("hybrid", "zigzag", 13, "2d"),
}


def _meshes():
    from torch.distributed.device_mesh import init_device_mesh
    return {"cp2": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))["cp"],
            "cp4": init_device_mesh("cpu", (4,), mesh_dim_names=("cp",)),
            "2d": init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp_ring", "cp_ulysses"))}


def _packing(L):
    """cu_seqlens (S + 1,) int32 over B x L tokens and per-row positions (B, L) restarting per segment."""
    rows = PACKINGS[L]
    lens = [n for row in rows for n in row]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    return cu, positions


def _cp(meshes, mode, layout, mesh_kind):
    from common.parallel.context_parallel import ContextParallel
    mesh = meshes[mesh_kind]
    return ContextParallel(mesh, mode, layout=layout, ulysses_degree=2 if mode == "hybrid" and mesh.ndim == 1 else None)


def _cp_group(cp, meshes, mesh_kind):
    import torch.distributed as dist
    mesh = meshes[mesh_kind]
    return mesh.get_group() if mesh.ndim == 1 else dist.group.WORLD  # 2d: the world is the CP group


def _varlen_reference(q, k, v, cu, causal):
    """The single-process varlen kernel on (B, H, L, D) rows: out (B, H, L, D), lse (B, H, L)."""
    from common.kernels import attention
    b, h, n, d = q.shape
    flat = [t.transpose(1, 2).reshape(b * n, t.shape[1], d) for t in (q, k, v)]
    m = int((cu[1:] - cu[:-1]).max())
    out, lse = attention(*flat, causal=causal, return_lse=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                         max_seqlen_q=m, max_seqlen_k=m)
    return out.view(b, n, h, d).transpose(1, 2), lse.view(h, b, n).transpose(0, 1)


def _run_case(spec, meshes, seed):
    import torch.distributed as dist

    mode, layout, causal, hq, hkv, L, dtype, mesh_kind = spec
    cp = _cp(meshes, mode, layout, mesh_kind)
    cu, _ = _packing(L)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, hq, L, D, generator=g, dtype=dtype)
    k = torch.randn(B, hkv, L, D, generator=g, dtype=dtype)
    v = torch.randn(B, hkv, L, D, generator=g, dtype=dtype)
    w = torch.randn(B, hq, L, D, generator=g, dtype=dtype)

    rq, rk, rv = (t.clone().requires_grad_() for t in (q, k, v))
    ref, ref_lse = _varlen_reference(rq, rk, rv, cu, causal)
    (ref * w).sum().backward()

    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    qs, ks, vs = cp.shard(q, 2), cp.shard(k, 2), cp.shard(v, 2)
    out_l, lse_l = cp.attention(qs, ks, vs, causal=causal, return_lse=True, cu_seqlens=cu,
                                max_seqlen=int((cu[1:] - cu[:-1]).max()))
    out = cp.gather(out_l, 2)
    lse = cp.gather(lse_l, 2)
    (out * w).sum().backward()
    grads = []
    for t in (q, k, v):
        gr = t.grad.clone()
        dist.all_reduce(gr, group=_cp_group(cp, meshes, mesh_kind))
        grads.append(gr / cp.size)
    errs = {"out": (out - ref).abs().max().item(), "lse": (lse - ref_lse.float()).abs().max().item()}
    errs["ref_max"] = max(ref.abs().max().item(), *(t.grad.abs().max().item() for t in (rq, rk, rv)))
    for name, gr, rt in zip("qkv", grads, (rq, rk, rv)):
        errs["d" + name] = (gr - rt.grad).abs().max().item()
    # fp32: elementwise |a - b| <= 1e-6 + 1e-5 |b| (assert_close's rule), recorded rather than raised
    # so that one failing case does not take the others' results down with it
    errs["close32"] = dtype != torch.float32 or all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip((out, *grads), (ref, rq.grad, rk.grad, rv.grad)))
    errs["finite"] = bool(torch.isfinite(out_l).all() and all(torch.isfinite(x).all() for x in grads))
    # padded query rows (positions >= L) come out as zeros
    pos = cp.positions(L)
    errs["pad_zero"] = bool((out_l.detach()[:, :, pos >= L] == 0).all())
    return errs


def _plan_checks(meshes):
    """Ring planning on the cp2 mesh, L=24 contiguous: rank r holds positions [12r, 12r + 12).
    Rows of two 12-token documents: rank 1's queries never meet rank 0's keys (the pair is
    skipped, a dense ring would compute it). One-document rows: only unmasked calls."""
    from common.parallel.context_parallel import ContextParallel
    cp = ContextParallel(meshes["cp2"], "ring")
    x = torch.randn(B, 2, 12, D, dtype=torch.float64)
    res = {}
    for name, cu in (("split", torch.tensor([0, 12, 24, 36, 48], dtype=torch.int32)),
                     ("onedoc", torch.tensor([0, 24, 48], dtype=torch.int32))):
        cp.attention(x, x, x, causal=True, cu_seqlens=cu, seq_len=24)
        ring = cp._ring(12, 24, True, D ** -0.5)
        packed = cp._packed(ring, cu, B, 24, True, x.device)
        res[name] = {src: packed.plan(src) for src in range(2)}
        cp.attention(x, x, x, causal=True, cu_seqlens=cu, seq_len=24)  # cache hit: same object
        res[name + "-cached"] = cp._packed(ring, cu, B, 24, True, x.device) is packed
    return res


def _refusal(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _refusals(meshes):
    uly, ring = _cp(meshes, "ulysses", "contiguous", "cp2"), _cp(meshes, "ring", "zigzag", "cp2")
    x = torch.randn(B, 4, 4, D)  # local shard of L = 8
    short = torch.tensor([0, 5, 8, 15], dtype=torch.int32)      # 15 of the 2 x 8 = 16 tokens
    crossing = torch.tensor([0, 5, 11, 16], dtype=torch.int32)  # [5, 11) crosses the row boundary 8
    return {
        "uly-short": _refusal(lambda: uly.attention(x, x, x, causal=True, cu_seqlens=short, seq_len=8)),
        "ring-short": _refusal(lambda: ring.attention(x, x, x, causal=True, cu_seqlens=short, seq_len=8)),
        "uly-crossing": _refusal(lambda: uly.attention(x, x, x, causal=True, cu_seqlens=crossing, seq_len=8)),
        "ring-crossing": _refusal(lambda: ring.attention(x, x, x, causal=True, cu_seqlens=crossing, seq_len=8)),
    }


def _llama_case(spec, meshes, seed):
    """Tiny float64 Llama on packed rows: CP (shard at the first block, gather before the final
    norm) against the same model unsharded."""
    import copy

    import torch.distributed as dist

    from common.nn.llama import Llama, LlamaConfig

    mode, layout, L, mesh_kind = spec
    cp = _cp(meshes, mode, layout, mesh_kind)
    torch.manual_seed(seed)
    cfg = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61, ffn_hidden=40, max_seq_len=64)
    ref_model = Llama(cfg).double()
    model = copy.deepcopy(ref_model)
    cu, positions = _packing(L)
    max_seqlen = int((cu[1:] - cu[:-1]).max())
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (B, L), generator=g)
    w = torch.randn(B, L, cfg.vocab_size, generator=g, dtype=torch.float64)

    first = model.blocks[0]

    def shard_block_inputs(block, args):
        h, (cos, sin), mask = args
        if block is first:
            h = cp.shard(h, 1)
        return h, (cp.shard(cos, 2), cp.shard(sin, 2)), mask  # per-row RoPE (B, 1, L, hd) follows its tokens

    for block in model.blocks:
        block.attention.attn_impl = cp.attention
        block.register_forward_pre_hook(shard_block_inputs)
    model.norm.register_forward_pre_hook(lambda _, args: (cp.gather(args[0], 1), *args[1:]))

    ref = ref_model(tokens, positions=positions, cu_seqlens=cu, max_seqlen=max_seqlen)
    (ref * w).sum().backward()
    out = model(tokens, positions=positions, cu_seqlens=cu, max_seqlen=max_seqlen)
    (out * w).sum().backward()
    group = _cp_group(cp, meshes, mesh_kind)
    errs = {"logits": (out - ref).abs().max().item(), "grad": 0.0, "ref_max": ref.abs().max().item()}
    ref_params = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        gr = p.grad.clone()
        dist.all_reduce(gr, group=group)  # the data-parallel reduction averages over dp x cp
        errs["grad"] = max(errs["grad"], (gr / cp.size - ref_params[name].grad).abs().max().item())
        errs["ref_max"] = max(errs["ref_max"], ref_params[name].grad.abs().max().item())
    # control: the packing matters (plain causal rows give different logits)
    plain = ref_model(tokens, positions=positions)
    errs["control"] = (plain - ref).abs().max().item()
    return errs


def _worker(rank, world_size):
    import time
    meshes = _meshes()
    out = {}
    for i, (name, spec) in enumerate(CASES.items()):
        t0 = time.perf_counter()
        out[name] = _run_case(spec, meshes, seed=i)
        out[name]["seconds"] = time.perf_counter() - t0
    for i, (name, spec) in enumerate(LLAMA_CASES.items()):
        out[name] = _llama_case(spec, meshes, seed=100 + i)
    out["plans"] = _plan_checks(meshes)
    out["refusals"] = _refusals(meshes)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, 4)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_varlen_kernel(results, name):
    errs = {key: max(r[name][key] for r in results) for key in ("out", "lse", "dq", "dk", "dv")}
    assert all(r[name]["finite"] and r[name]["pad_zero"] and r[name]["close32"] for r in results), name
    ref_max = max(r[name]["ref_max"] for r in results)
    # fp32: the elementwise rtol 1e-5 / atol 1e-6 check ran on the ranks (close32); this is its max-norm form
    tol = TOL64 if CASES[name][6] == torch.float64 else 1e-6 + 1e-5 * ref_max
    assert errs["lse"] < 1e-5, (name, errs)  # lse comes back as fp32 (kernels.attention's contract)
    assert max(errs["out"], errs["dq"], errs["dk"], errs["dv"]) < tol, (name, errs)
    print(name, {k: f"{v:.1e}" for k, v in errs.items()})


@pytest.mark.parametrize("name", list(LLAMA_CASES))
def test_llama_packed_rows_match_unsharded(results, name):
    errs = {key: max(r[name][key] for r in results) for key in ("logits", "grad", "control")}
    assert errs["logits"] < TOL64 and errs["grad"] < TOL64, (name, errs)
    assert errs["control"] > 1e-3, (name, errs)  # the document boundaries do change the result
    print(name, {k: f"{v:.1e}" for k, v in errs.items()})


def test_ring_plan_skips_and_unmasks(results):
    for rank, r in enumerate(results):
        plans = r["plans"]
        cp_rank = rank % 2  # cp2 is the inner dim of (dp 2, cp 2)
        # split documents: only the diagonal block pair has work, and it needs no mask
        assert plans["split"][(cp_rank - 1) % 2] == [], plans["split"]
        assert all(not call[4] for call in plans["split"][cp_rank])
        # one document per row (B rows alike in shape): the dense ring's calls, no masks
        assert all(not call[4] for src in (0, 1) for call in plans["onedoc"][src])
        assert bool(plans["onedoc"][1 - cp_rank]) == (cp_rank == 1)
        assert plans["split-cached"] and plans["onedoc-cached"]


def test_refusals(results):
    m = results[0]["refusals"]
    for mode in ("uly", "ring"):
        assert "cu_seqlens must rise from 0 to the 2 x 8 = 16 tokens" in m[f"{mode}-short"], m
        assert "segment 1 [5, 11) crosses the boundary of rows 0 and 1 at token 8" in m[f"{mode}-crossing"], m


def test_single_rank_is_the_varlen_kernel():
    from common.parallel.context_parallel import ContextParallel
    cu, _ = _packing(13)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, 13, D, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    out = ContextParallel(None).attention(q, k, v, causal=True, cu_seqlens=cu)
    ref, _ = _varlen_reference(q, k, v, cu, True)  # the lse path (math) vs SDPA per sequence
    torch.testing.assert_close(out, ref, rtol=0, atol=TOL64)
