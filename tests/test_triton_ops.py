"""Triton norm / RoPE / SwiGLU / cross-entropy kernels and the kernel backend selection.

The kernel numerics run in a child process (tests/triton_checks/ops_checks.py): on CPU through
the Triton interpreter, which must be enabled before triton is imported; natively when CUDA is
present. The rule each kernel output meets is in that script's docstring. The rest are
in-process checks of the torch paths (chunked cross-entropy vs eager, its memory) and of
backend.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from common.kernels import (AUTO_TRITON_OPS, cross_entropy, cross_entropy_eager, resolve_backend, rms_norm, swiglu,
                            use_backend)
from common.kernels import backend as kb
from tests.triton_checks import CHECK_SEED_ARGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKS = os.path.join(ROOT, "tests", "triton_checks", "ops_checks.py")


@pytest.fixture(autouse=True)
def _fixed_inputs():
    """Inputs drawn without an explicit generator are the same every run (a failure reproduces)."""
    torch.manual_seed(0)


def _run_checks(*args: str, interpret: bool, timeout: int = 240) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), MMP_KERNEL_POISON="1")
    env.pop("TRITON_INTERPRET", None)
    env.pop("MMP_KERNEL_BACKEND", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
        env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, CHECKS, *args, *CHECK_SEED_ARGS], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    report = json.loads(lines[-1]) if lines else {}
    failed = [r for r in report.get("results", []) if not r["ok"]]
    assert proc.returncode == 0 and report.get("ok"), (
        f"kernel checks failed (rc {proc.returncode}, seed {report.get('seed')}):\n"
        + "\n".join(json.dumps(r) for r in failed) + f"\n{proc.stderr[-4000:]}")
    return report


def test_triton_kernels_interpreted_on_cpu():
    report = _run_checks("--device", "cpu", interpret=True)
    ops = {r["op"] for r in report["results"]}
    assert ops == {"rms_norm", "layer_norm", "norm_modulate", "rope", "swiglu", "cross_entropy"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_kernels_native_cuda():
    _run_checks("--device", "cuda", interpret=False)


def _ptxas_present() -> bool:
    import importlib.util
    spec = importlib.util.find_spec("triton")
    return spec is not None and os.path.exists(
        os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin", "ptxas"))


@pytest.mark.skipif(not _ptxas_present(), reason="needs triton with its bundled ptxas")
def test_triton_kernels_compile_for_sm90():
    """Every kernel variant the wrappers launch compiles for Hopper, no GPU needed: catches what
    the interpreter lets through (loop-carried types, constexpr misuse)."""
    report = _run_checks("--compile-sm90", interpret=False)
    assert {r["kernel"] for r in report["results"]} >= {"_norm_fwd", "_norm_bwd", "_rope_kernel", "_swiglu_fwd",
                                                        "_swiglu_bwd", "_ce_fwd_chunk", "_ce_grad_chunk"}


# ---- chunked cross-entropy (torch path) -------------------------------------------------------

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk", [7, 64, None])
def test_chunked_cross_entropy_equals_eager_fp64(reduction, chunk):
    g = torch.Generator().manual_seed(0)
    t, d, v = 29, 12, 150  # 150 rows of vocabulary: not a multiple of 7 or 64
    h = torch.randn(2, t, d, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, d, generator=g, dtype=torch.float64, requires_grad=True)
    tgt = torch.randint(0, v, (2, t), generator=g)
    tgt[0, ::4] = -100
    tgt[1, 3] = 5  # targets in the first slice as well
    ref = cross_entropy_eager(h.reshape(-1, d), w, tgt.reshape(-1), reduction=reduction)
    out = cross_entropy(h, w, tgt, chunk_size=chunk, reduction=reduction, backend="torch")
    ref = ref.view(tgt.shape) if reduction == "none" else ref
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    go = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    gr = torch.autograd.grad(ref, (h, w), go)
    gc = torch.autograd.grad(out, (h, w), go)
    for a, b in zip(gc, gr):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # "reference" is the eager path; custom ignore_index works as in F.cross_entropy
    torch.testing.assert_close(cross_entropy(h, w, tgt, reduction=reduction, backend="reference"), ref)
    tgt2 = tgt.masked_fill(tgt == -100, 7)
    torch.testing.assert_close(cross_entropy(h, w, tgt2, ignore_index=7, chunk_size=chunk, reduction=reduction),
                               cross_entropy(h, w, tgt2, ignore_index=7, reduction=reduction, backend="reference"),
                               rtol=1e-10, atol=1e-12)


class _LargestTensor(TorchDispatchMode):
    """Largest tensor any op produces while active (forward and, on CPU, backward too)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in tree_leaves(out):
            if isinstance(x, torch.Tensor):
                self.numel = max(self.numel, x.numel())
        return out


def _footprint(fn):
    saved = []

    def pack(x):
        saved.append((tuple(x.shape), x.dtype))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x), _LargestTensor() as mode:
        fn().backward()
    return saved, mode.numel


def test_chunked_cross_entropy_never_holds_token_by_vocab_logits():
    t, d, v, chunk = 64, 16, 1000, 128
    h = torch.randn(t, d, requires_grad=True)
    w = torch.randn(v, d, requires_grad=True)
    tgt = torch.randint(0, v, (t,))
    saved, largest = _footprint(lambda: cross_entropy(h, w, tgt, chunk_size=chunk, backend="torch"))
    # saved for backward: hidden, weight, targets, lse (T,), valid count: no (T, V) or (T, chunk)
    assert all(s[0] not in ((t, v), (v, t)) and (len(s[0]) < 2 or s[0] in ((t, d), (v, d))) for s in saved), saved
    assert largest <= max(t * chunk, v * d) < t * v
    # the measurement sees eager's logits (the control)
    saved_e, largest_e = _footprint(lambda: cross_entropy_eager(h, w, tgt))
    assert largest_e == t * v and any(s == ((t, v), torch.float32) for s in saved_e)


def test_cross_entropy_argument_errors():
    h, w, tgt = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(h, w, tgt, reduction="avg")
    with pytest.raises(ValueError, match="does not match"):
        cross_entropy(h, torch.randn(10, 9), tgt)
    with pytest.raises(ValueError, match="targets"):
        cross_entropy(h, w, tgt[:3])


def test_swiglu_torch_forms_agree():
    x = torch.randn(3, 4, 20)
    ref = torch.nn.functional.silu(x[..., :10]) * x[..., 10:]
    torch.testing.assert_close(swiglu(x), ref)
    torch.testing.assert_close(swiglu(x[..., :10], x[..., 10:]), ref)
    with pytest.raises(ValueError, match="even"):
        swiglu(torch.randn(2, 5))


# ---- backend selection ---------------------------------------------------------------------

def test_backend_precedence_env_context_argument(monkeypatch):
    monkeypatch.delenv("MMP_KERNEL_BACKEND", raising=False)
    assert resolve_backend() == "torch"
    monkeypatch.setenv("MMP_KERNEL_BACKEND", "reference")
    assert resolve_backend() == "reference" and resolve_backend(op="rms_norm", device=torch.device("cpu")) == "reference"
    with use_backend("torch"):
        assert resolve_backend() == "torch"  # context beats env
        assert resolve_backend("reference") == "reference"  # argument beats context
    assert resolve_backend() == "reference"
    monkeypatch.setenv("MMP_KERNEL_BACKEND", "Torch")  # case-insensitive
    assert resolve_backend() == "torch"


def test_unknown_backend_is_a_clear_error(monkeypatch):
    with pytest.raises(ValueError, match=r"unknown kernel backend 'cuda-magic'.*expected one of"):
        rms_norm(torch.randn(2, 4), backend="cuda-magic")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        with use_backend("fast"):
            pass
    monkeypatch.setenv("MMP_KERNEL_BACKEND", "tritonn")
    with pytest.raises(ValueError, match="'tritonn'"):
        rms_norm(torch.randn(2, 4))


def test_auto_table(monkeypatch):
    monkeypatch.delenv("MMP_KERNEL_BACKEND", raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # resolve_backend never touches the device
    assert AUTO_TRITON_OPS <= kb.TRITON_OPS
    monkeypatch.setattr(kb, "AUTO_TRITON_OPS", frozenset({"rms_norm", "swiglu"}))  # as a benchmark would set it
    for op in kb.TRITON_OPS:
        listed = op in kb.AUTO_TRITON_OPS
        assert resolve_backend(op=op, device=cpu) == "torch"
        assert resolve_backend(op=op, device=cuda) == ("triton" if listed and kb.triton_available() else "torch")
        assert resolve_backend(op=op, device=None) == "torch"  # tensor subclasses (DTensor)
    assert resolve_backend(op="attention", device=cuda) == "torch"  # not in the table
    monkeypatch.setattr(kb, "_triton_available", False)
    assert resolve_backend(op="rms_norm", device=cuda) == "torch"


def test_triton_backend_rules(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("MMP_KERNEL_BACKEND", raising=False)
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        rms_norm(x, backend="triton")
    with pytest.raises(ValueError, match="attention only"):
        rms_norm(x, backend="flash_attn")
    with use_backend("flash_attn"):  # a global attention preference leaves other ops on auto
        torch.testing.assert_close(rms_norm(x), rms_norm(x, backend="torch"))
    with pytest.raises(ValueError, match="DTensor"):
        resolve_backend("triton", op="rms_norm", device=None)
    with use_backend("triton"):
        assert resolve_backend(op="rms_norm", device=None) == "torch"


def test_import_is_cheap():
    code = "import sys, common.kernels; assert 'triton' not in sys.modules, 'triton imported'"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
