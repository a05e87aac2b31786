"""Normalisation dispatch: RMSNorm, LayerNorm and the DiT adaLN modulation.

Statistics are computed in fp32 even for bf16 inputs (variance of bf16 activations loses
precision fast), and the result is cast back to the input dtype. The "triton" backend runs the
fused kernels of common/kernels/triton/norm.py (one read of x, one write of y per pass). Calls
they do not cover (rows wider than 16k, fp64, other broadcasts) use the torch path, or raise
when backend="triton" was passed as the argument (see backend.unserved).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import dispatch_device, resolve_backend, unserved


def _triton_norm():
    from .triton import norm  # lazy: importing triton costs ~1 s and is CUDA/interpreter only
    return norm


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
             *, backend: str | None = None) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension."""
    impl = resolve_backend(backend, op="rms_norm", device=dispatch_device(x, weight))
    if impl == "triton":
        tn = _triton_norm()
        if tn.supports(x, weight):
            return tn.norm(x, weight, None, eps, rms=True)
        impl = unserved("rms_norm", backend, tn.SUPPORTED)
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-6, *, backend: str | None = None) -> torch.Tensor:
    """LayerNorm over the last dimension; weight/bias optional (None = no affine)."""
    impl = resolve_backend(backend, op="layer_norm", device=dispatch_device(x, weight, bias))
    if impl == "triton":
        tn = _triton_norm()
        if tn.supports(x, weight, bias):
            return tn.norm(x, weight, bias, eps, rms=False)
        impl = unserved("layer_norm", backend, tn.SUPPORTED)
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    if impl == "reference":
        mu = xf.mean(-1, keepdim=True)
        var = (xf - mu).pow(2).mean(-1, keepdim=True)
        y = (xf - mu) * torch.rsqrt(var + eps)
        if weight is not None:
            y = y * weight.to(y.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
    else:
        w = None if weight is None else weight.to(xf.dtype)
        b = None if bias is None else bias.to(xf.dtype)
        y = F.layer_norm(xf, (x.shape[-1],), w, b, eps)
    return y.to(x.dtype)


def _per_sample(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # (B, D) -> (B, 1, D) so one vector per sample broadcasts over the token axis.
    return v.unsqueeze(1) if v.dim() == 2 and x.dim() == 3 else v


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x * (1 + scale) + shift; x (B, L, D), shift/scale (B, D) or (B, 1, D).
    Torch only: alone it is one elementwise pass that torch.compile fuses into its neighbours;
    the case worth a kernel is norm_modulate."""
    # One fused multiply-add instead of a multiply and an add (eager glue is a large share of a
    # small DiT's CPU step).
    return torch.addcmul(_per_sample(shift, x), x, 1 + _per_sample(scale, x))


def norm_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6,
                  *, backend: str | None = None) -> torch.Tensor:
    """DiT adaLN: LayerNorm without affine (the modulation replaces it), then modulate.
    The Triton backend does both in one pass (x read once, y written once) with fp32 math."""
    impl = resolve_backend(backend, op="norm_modulate", device=dispatch_device(x, shift, scale))
    if impl == "triton":
        tn = _triton_norm()
        if tn.supports(x, shift, scale):
            y = tn.norm_modulate(x, None, None, shift, scale, eps)
            if y is not None:
                return y
        impl = unserved("norm_modulate", backend, tn.SUPPORTED + "; shift/scale (B, D), (B, 1, D) or x's shape")
    return modulate(layer_norm(x, None, None, eps, backend="reference" if impl == "reference" else "torch"),
                    shift, scale)
