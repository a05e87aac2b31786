"""Triton FlashAttention: kernel numerics (CPU through the Triton interpreter, natively on CUDA)
and the attention() dispatch (varlen on every backend, argument errors, "auto" choices).

The kernel checks run tests/triton_checks/attention_checks.py in a subprocess: TRITON_INTERPRET=1
must be set before triton is imported, and this pytest process may already have imported it.
The checker runs on fixed inputs (seed 0; MMP_CHECK_SEED=N or =random for others, the seed is in
every failure message; rerun one with `--seed`), poisons every kernel output with NaN (MMP_KERNEL_POISON=1), and holds out, lse,
dq, dk and dv to 2x the fp32 torch error vs float64 plus a stated floor (see its docstring).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from common.kernels import attention, attention_reference, use_backend
from common.kernels.attention import _auto
from tests.triton_checks import CHECK_SEED_ARGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKER = os.path.join(ROOT, "tests", "triton_checks", "attention_checks.py")
GROUPS = ["dense", "cross", "gqa", "varlen", "lse_grad", "layout", "d128"]
CUDA_GROUPS = GROUPS + ["cuda_large", "bf16"]
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _fixed_inputs():
    """Inputs drawn without an explicit generator are the same every run (a failure reproduces)."""
    torch.manual_seed(0)


def _run_checker(device: str) -> dict[str, list[dict]]:
    """Every case's JSON line by group, plus "_proc": one (rc, stderr) per checker process.

    On CUDA one process per group, run at once: the native run's time is Triton's JIT compiling
    each new shape (2-7 s apiece, 104 s for all groups in one process on an H200), and compiles
    in separate processes overlap. The interpreter run stays one process (a 2-core machine)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["MMP_KERNEL_POISON"] = "1"
    env.pop("MMP_KERNEL_BACKEND", None)
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
        env["OMP_NUM_THREADS"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, CHECKER, "--device", device, *CHECK_SEED_ARGS]
    splits = [["--groups", g] for g in CUDA_GROUPS] if device == "cuda" else [[]]
    procs = [subprocess.Popen(cmd + extra, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for extra in splits]
    results: dict[str, list[dict]] = {}
    finished = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=600)
            for line in out.splitlines():
                if line.startswith("{"):
                    r = json.loads(line)
                    results.setdefault(r["group"], []).append(r)
            finished.append(dict(rc=proc.returncode, stderr=err[-4000:]))
    finally:
        for proc in procs:
            proc.kill()
    if not results:
        raise AssertionError("checker produced no results:\n"
                             + "\n".join(f"rc {p['rc']}: {p['stderr']}" for p in finished))
    results["_proc"] = finished
    return results


def _assert_group(results, group):
    rows = results.get(group)
    assert rows, (f"no cases ran for group {group!r}; checker stderr:\n"
                  + "\n".join(p["stderr"] for p in results["_proc"]))
    bad = [r for r in rows if not r["ok"]]
    msg = "\n".join(f"{r['name']} (seed {r['seed']}, rerun: attention_checks.py --seed {r['run_seed']} "
                    f"--groups {group}):\n  " + "\n  ".join(r["failures"]) for r in bad)
    assert not bad, msg


@pytest.fixture(scope="module")
def interpreter_results():
    return _run_checker("cpu")


@pytest.fixture(scope="module")
def cuda_results():
    return _run_checker("cuda")


@pytest.mark.parametrize("group", GROUPS)
def test_triton_attention_interpreter(group, interpreter_results):
    _assert_group(interpreter_results, group)


def test_interpreter_checker_exit_code(interpreter_results):
    # every case printed and none failed (a crash after the last JSON line shows up here)
    assert interpreter_results["_proc"][0]["rc"] == 0, interpreter_results["_proc"][0]["stderr"]


@cuda_only
@pytest.mark.parametrize("group", CUDA_GROUPS)
def test_triton_attention_cuda(group, cuda_results):
    _assert_group(cuda_results, group)


# ---------------------------------------------------------------------------------------------
# dispatch (in-process; no triton needed)
# ---------------------------------------------------------------------------------------------
ATOL, RTOL = 1e-5, 1e-4


def _packed(lq, lk, h=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), h, d, generator=g)
    k, v = torch.randn(sum(lk), hkv, d, generator=g), torch.randn(sum(lk), hkv, d, generator=g)
    cu = lambda lens: torch.tensor([0] + lens).cumsum(0).to(torch.int32)  # noqa: E731
    return q, k, v, cu(lq), cu(lk)


def _per_sequence(q, k, v, cu_q, cu_k, causal):
    """(out, lse) from attention_reference on each sequence on its own, in float64."""
    outs, lses = [], []
    rep = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qi = q[cu_q[i]:cu_q[i + 1]].transpose(0, 1)[None].double()
        ki, vi = (x[cu_k[i]:cu_k[i + 1]].transpose(0, 1)[None].double().repeat_interleave(rep, 1) for x in (k, v))
        o, l = attention_reference(qi, ki, vi, causal=causal)
        outs.append(o[0].transpose(0, 1))
        lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, -1)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_dispatch_equals_per_sequence(backend, causal):
    lq, lk = [1, 17, 40, 5], [3, 17, 20, 9]
    q, k, v, cu_q, cu_k = _packed(lq, lk)
    ref, ref_lse = _per_sequence(q, k, v, cu_q, cu_k, causal)
    kw = dict(causal=causal, backend=backend, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=40, max_seqlen_k=20)
    out = attention(q, k, v, **kw)
    assert out.shape == q.shape
    fin = torch.isfinite(ref_lse).T[..., None].expand_as(ref)  # SDPA leaves empty rows undefined
    torch.testing.assert_close(out.double()[fin], ref[fin], atol=ATOL, rtol=RTOL)
    out2, lse = attention(q, k, v, return_lse=True, **kw)
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    torch.testing.assert_close(out2.double(), ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(lse.double(), ref_lse, atol=ATOL, rtol=RTOL)


def test_varlen_never_crosses_sequences():
    """Changing one sequence's keys leaves every other sequence's output untouched."""
    q, k, v, cu_q, cu_k = _packed([5, 7, 3], [5, 7, 3])
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out = attention(q, k, v, **kw)
    k2 = k.clone()
    k2[5:12] += 1.0
    out2 = attention(q, k2, v, **kw)
    assert torch.equal(out[:5], out2[:5]) and torch.equal(out[12:], out2[12:])
    assert not torch.allclose(out[5:12], out2[5:12])


def test_varlen_gradients_flow_on_loop_path():
    q, k, v, cu_q, cu_k = _packed([4, 9], [6, 2])
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out, lse = attention(q, k, v, causal=True, return_lse=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_reference_backward_finite_on_fully_masked_rows():
    """Causal with Lq > Lk leaves rows with no key: out 0, lse -inf, and finite (zero) gradients."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 6, 8, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 3, 8, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 3, 8, generator=g, requires_grad=True)
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    assert torch.isneginf(lse[..., :3]).all() and torch.all(out[..., :3, :] == 0)
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.all(q.grad[..., :3, :] == 0)


def test_forced_triton_with_attn_mask_raises():
    q = torch.randn(1, 2, 4, 16)
    mask = torch.ones(1, 1, 1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="does not support attn_mask"):
        attention(q, q, q, attn_mask=mask, backend="triton")
    with pytest.raises(ValueError, match="does not support attn_mask"):
        attention(q, q, q, attn_mask=mask, backend="flash_attn")


def test_global_triton_preference_routes_masked_calls():
    """use_backend/env "triton" is a preference: a masked call goes where "auto" sends it, while
    an unmasked CPU call without the interpreter still fails loudly."""
    q = torch.randn(1, 2, 4, 16)
    mask = torch.tensor([True, True, False, True])[None, None, None]
    with use_backend("triton"):
        out = attention(q, q, q, attn_mask=mask)
        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            with pytest.raises(ValueError, match="CUDA"):
                attention(q, q, q)
    torch.testing.assert_close(out, attention(q, q, q, attn_mask=mask, backend="reference"), atol=ATOL, rtol=RTOL)


def test_auto_on_cpu_and_argument_errors():
    q = torch.randn(1, 2, 4, 16)
    assert _auto(q, q, q, None, False, False) == "torch"
    assert _auto(q, q, q, None, True, False) == "reference"
    qv = torch.randn(4, 2, 16)
    assert _auto(qv, qv, qv, None, False, True) == "torch"
    assert _auto(qv, qv, qv, None, True, True) == "reference"
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="both cu_seqlens"):
        attention(qv, qv, qv, cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="3-D"):
        attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu)
    with pytest.raises(ValueError):
        attention(q, q, q, backend="cuda-magic")
    assert math.isclose(float(attention(q, q, q, scale=0.0)[0, 0, 0, 0]), float(q[0, 0, :, 0].mean()), rel_tol=1e-5)
