"""Kernel backend selection shared by every dispatch module.

Values: "auto" (best available: Triton on CUDA once it lands, torch otherwise), "torch" (fused
torch ops such as SDPA), "reference" (explicit math; slow, but every matmul is visible to
FlopCounterMode and numerics are easy to reason about). Precedence: function argument >
`use_backend` context > env var MMP_KERNEL_BACKEND > "auto".
"""
from __future__ import annotations

import contextlib
import os

BACKENDS = ("auto", "torch", "reference")
_override: str | None = None


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; expected one of {BACKENDS}")
    return name


def resolve_backend(backend: str | None = None) -> str:
    """Return the concrete backend ("torch" or "reference") to use for this call."""
    name = backend or _override or os.environ.get("MMP_KERNEL_BACKEND", "auto")
    name = _check(name.lower())
    # No Triton kernels yet: "auto" means torch on every device.
    return "torch" if name == "auto" else name


@contextlib.contextmanager
def use_backend(name: str):
    """Temporarily force a backend for all kernels (e.g. "reference" for FLOP counting)."""
    global _override
    prev, _override = _override, _check(name)
    try:
        yield
    finally:
        _override = prev
