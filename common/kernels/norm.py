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
from .rope import apply_rope


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
    if impl == "torch" and _fused_eager(x, weight):
        return _RMSNormRope.apply(x, weight, None, None, eps)
    return _rms_norm_composite(x, weight, eps)


def _rms_norm_composite(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                  rope: tuple[torch.Tensor, torch.Tensor] | None, *, backend: str | None = None) -> torch.Tensor:
    """QK-norm then RoPE: apply_rope(rms_norm(x, weight, eps), *rope); rope None = the norm alone.
    x (B, H, L, D), rope tables (L, D) or broadcastable. Eager on the torch backend this is one
    autograd node with a hand-written backward (see _RMSNormRope); otherwise the two ops."""
    if rope is None:
        return rms_norm(x, weight, eps, backend=backend)
    cos, sin = rope
    impl = resolve_backend(backend, op="rms_norm", device=dispatch_device(x, weight, cos, sin))
    if (impl == "torch" and cos.shape[-1] == x.shape[-1] and not cos.requires_grad and not sin.requires_grad
            and _fused_eager(x, weight)):
        return _RMSNormRope.apply(x, weight, cos, sin, eps)
    return apply_rope(rms_norm(x, weight, eps, backend=backend), cos, sin, backend=backend)


def _fused_eager(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    # Under torch.compile Inductor fuses the composite itself (and may recompute rather than
    # save); fp64 keeps the composite as the exact reference.
    # Tensor subclasses (DTensor) keep to plain torch ops (see dispatch_device).
    return (not torch.compiler.is_compiling() and x.dtype != torch.float64
            and (weight is None or weight.dim() == 1) and dispatch_device(x, weight) is not None)


class _RMSNormRope(torch.autograd.Function):
    """y = rope(x * r * w), r = rsqrt(mean(x^2) + eps), rotate-half RoPE (optional).

    Autograd through the composite records ~9 full-size elementwise ops forward and ~20 backward
    for norm + RoPE (pow, mean, rsqrt, two muls, chunk/neg/cat, addcmul and their backward
    graphs): on a CPU DiT step they cost about as much as the attention itself. Here forward is
    ~5 passes and backward ~7, saving only x_hat and r. Math in fp32 for half inputs."""

    @staticmethod
    def forward(ctx, x, weight, cos, sin, eps):
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        # One reduction pass for mean(x^2): the 2-norm squared over D.
        r = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().div_(xf.shape[-1]).add_(eps).rsqrt_()
        x_hat = xf * r
        u = x_hat if weight is None else x_hat * weight.to(xf.dtype)
        if cos is not None:
            c, s = cos.to(xf.dtype), sin.to(xf.dtype)
            y, h = u * c, u.shape[-1] // 2
            # rotate_half(u) * s without materialising rotate_half(u): y1 -= u2 s1, y2 += u1 s2
            y[..., :h].addcmul_(u[..., h:], s[..., :h], value=-1)
            y[..., h:].addcmul_(u[..., :h], s[..., h:])
        else:
            c = s = None
            y = u
        ctx.save_for_backward(x_hat, r, weight, c, s)
        ctx.x_dtype = x.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x_hat, r, weight, c, s = ctx.saved_tensors
        g = g.to(x_hat.dtype)
        if c is not None:  # transpose of the rotation: du1 = g1 c1 + g2 s2, du2 = g2 c2 - g1 s1
            gu, h = g * c, g.shape[-1] // 2
            gu[..., :h].addcmul_(g[..., h:], s[..., h:])
            gu[..., h:].addcmul_(g[..., :h], s[..., :h], value=-1)
        else:
            gu = g
        grad_w = None
        if weight is not None:
            if ctx.needs_input_grad[1]:
                grad_w = (gu * x_hat).sum(dim=tuple(range(gu.dim() - 1))).to(weight.dtype)
            gu = gu * weight.to(gu.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            # d/dx of x * r(x): r (gu - x_hat * mean(gu * x_hat))
            dot = (gu * x_hat).mean(-1, keepdim=True)
            grad_x = torch.addcmul(gu, x_hat, dot, value=-1).mul_(r).to(ctx.x_dtype)
        return grad_x, grad_w, None, None, None


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
