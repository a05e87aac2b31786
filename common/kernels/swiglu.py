"""SwiGLU gate dispatch: silu(a) * b, the elementwise middle of a Llama-style gated MLP.

Two call forms: swiglu(a, b), or swiglu(x) on the fused projection x = [a | b] (last dim 2N),
which lets the Triton backward write both halves of the gradient into one buffer instead of
autograd concatenating two. The kernel computes in fp32 and rounds once; the torch path stays in
the input dtype (an fp32 upcast there would also save fp32 copies for backward: 2x the memory).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import dispatch_device, resolve_backend, unserved


def swiglu(a: torch.Tensor, b: torch.Tensor | None = None, *, backend: str | None = None) -> torch.Tensor:
    """silu(a) * b; with b None, a is the fused [a | b] tensor split in half on the last dim."""
    if b is None and a.shape[-1] % 2:
        raise ValueError(f"fused swiglu needs an even last dim, got {a.shape[-1]}")
    impl = resolve_backend(backend, op="swiglu", device=dispatch_device(a, b))
    if impl == "triton":
        from .triton import swiglu as ts  # lazy: triton is imported only when used
        if b is None and ts.supports(a):
            return ts.swiglu_fused(a)
        if b is not None and ts.supports(a, b):
            return ts.swiglu(a, b)
        unserved("swiglu", backend, ts.SUPPORTED)
    if b is None:
        a, b = a.chunk(2, dim=-1)
    return F.silu(a) * b
