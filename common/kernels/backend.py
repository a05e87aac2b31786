"""Kernel backend selection shared by every dispatch module.

Values:
  "auto"       the measured best for the op and device: on CUDA with triton installed, our Triton
               kernel for the ops listed in AUTO_TRITON_OPS, torch otherwise; torch on CPU.
  "torch"      fused torch ops (SDPA, F.layer_norm, chunked torch cross-entropy, ...).
  "reference"  explicit math; slow, but every matmul is visible to FlopCounterMode and numerics
               are easy to reason about.
  "triton"     our Triton kernels (common/kernels/triton/). CUDA tensors, or CPU tensors under
               TRITON_INTERPRET=1 (how the numerics are tested on machines without a GPU).
  "flash_attn" the flash-attn package; attention only (set globally, other ops resolve as "auto").
Precedence: function argument > `use_backend` context > env var MMP_KERNEL_BACKEND > "auto".
A backend passed as an op's argument is a contract: a call it cannot serve (dtype, shape, tensor
subclass) raises ValueError. One set globally is a preference: such calls take the torch path
(see `unserved`). "triton" with CPU tensors and no interpreter is an error either way.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os

import torch

BACKENDS = ("auto", "torch", "reference", "triton", "flash_attn")

# Ops for which "auto" picks the Triton kernel on CUDA. The GPU benchmark (bench/kernels.py)
# decides membership: an op joins only once its Triton kernel has measured at least as fast as
# the torch path at every size it times (its JSON prints the verdict per op as `auto_triton`).
# First measured on an H200 (bench/results/gpu/2026-12-04-h200/kernels.json): forward+backward
# 2.2-13x the speed of the torch path for the norms, norm+modulate and RoPE, 1.4-1.7x for SwiGLU.
# Not listed: cross_entropy (0.75x the speed of the eager matmul + log-softmax; its gain is memory,
# 0.23x) and attention (0.72-0.93x SDPA's flash backend; LSE / varlen calls, which SDPA cannot
# serve, use Triton regardless). Under torch.compile and for DTensor "auto" still means torch.
AUTO_TRITON_OPS: frozenset[str] = frozenset({"rms_norm", "layer_norm", "norm_modulate", "rope", "swiglu"})
TRITON_OPS = frozenset({"rms_norm", "layer_norm", "norm_modulate", "rope", "swiglu", "cross_entropy"})

_override: str | None = None
_triton_available: bool | None = None


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; expected one of {BACKENDS}")
    return name


def triton_available() -> bool:
    """True when triton is installed; checked without importing it (keeps `import common` cheap)."""
    global _triton_available
    if _triton_available is None:
        _triton_available = importlib.util.find_spec("triton") is not None
    return _triton_available


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def requested_backend(backend: str | None = None) -> str:
    """The validated backend name before "auto" is resolved."""
    return _check((backend or _override or os.environ.get("MMP_KERNEL_BACKEND") or "auto").lower())


def resolve_backend(backend: str | None = None, op: str | None = None,
                    device: torch.device | None = None) -> str:
    """Return the concrete backend for this call: "torch", "reference", "triton" or "flash_attn".

    Without `op`/`device` (the historical call) "auto" resolves to "torch". With them, "auto"
    picks Triton when `op` is in AUTO_TRITON_OPS, `device` is CUDA, triton is installed and no
    torch.compile trace is running (Inductor generates its own fused kernels; an opaque
    autograd.Function would only break the graph). Pass device=None for tensor subclasses
    (DTensor; see dispatch_device): they implement torch ops, not raw pointers, so "auto" sends
    them to torch. "flash_attn" set globally means "auto" for ops other than attention; passed
    as the argument of such an op it is an error, like any backend that cannot serve a call.
    """
    name = requested_backend(backend)
    if name == "flash_attn" and op is not None and op != "attention":
        if backend is not None:
            raise ValueError(f"kernel backend 'flash_attn' implements attention only, not {op}")
        name = "auto"
    if name == "auto":
        if (op in AUTO_TRITON_OPS and device is not None and torch.device(device).type == "cuda"
                and triton_available() and not torch.compiler.is_compiling()):
            return "triton"
        return "torch"
    if name == "triton":
        if op is not None and device is None:  # a tensor subclass (DTensor): see dispatch_device
            return unserved(op, backend, "tensor subclasses such as DTensor take the torch path")
        if not triton_available():
            raise ValueError("kernel backend 'triton' needs the triton package (not installed)")
        if device is not None and torch.device(device).type != "cuda" and not triton_interpreting():
            raise ValueError(f"kernel backend 'triton' needs CUDA tensors (got {torch.device(device)}); "
                             "set TRITON_INTERPRET=1 before importing triton to run the kernels on CPU")
    return name


def unserved(op: str, backend: str | None, why: str) -> str:
    """The Triton kernel of `op` cannot take these arguments: an error when the caller passed the
    backend as an argument (a per-call contract), else "torch" (use_backend / the env var state a
    preference, and the torch path serves every call)."""
    if backend is not None and backend.lower() != "auto":
        raise ValueError(f"{op}: backend {backend!r} cannot serve this call ({why})")
    return "torch"


def dispatch_device(*tensors: torch.Tensor | None) -> torch.device | None:
    """Device for resolve_backend: that of the first tensor when every given tensor is a plain
    tensor (or Parameter), else None (a tensor subclass such as DTensor must stay on torch ops)."""
    dev = None
    for t in tensors:
        if t is None:
            continue
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            return None
        dev = t.device if dev is None else dev
    return dev


def _poison() -> bool:
    return os.environ.get("MMP_KERNEL_POISON", "0") not in ("", "0")


def new_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Allocation for kernel outputs. MMP_KERNEL_POISON=1 fills floating outputs with NaN so a
    tile the kernel forgot to write fails the tests instead of passing on leftover memory."""
    if _poison() and dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def new_output_like(t: torch.Tensor) -> torch.Tensor:
    """new_output with t's shape, dtype and (for dense t) memory layout."""
    out = torch.empty_like(t)
    return out.fill_(float("nan")) if _poison() and t.dtype.is_floating_point else out


@contextlib.contextmanager
def use_backend(name: str):
    """Temporarily force a backend for all kernels (e.g. "reference" for FLOP counting)."""
    global _override
    prev, _override = _override, _check(name)
    try:
        yield
    finally:
        _override = prev
