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
    4 passes making 2 full-size buffers (x_hat, y; the weight is folded into the RoPE tables) and
    backward ~8 passes making 3 (the rest in place), saving only x_hat and r. Each new buffer
    costs page faults on first touch, which on CPU weigh as much as a pass. Math in fp32 for
    half inputs."""

    @staticmethod
    def forward(ctx, x, weight, cos, sin, eps):
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        # One reduction pass for mean(x^2): the 2-norm squared over D.
        r = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().div_(xf.shape[-1]).add_(eps).rsqrt_()
        x_hat = xf * r
        w = None if weight is None else weight.to(xf.dtype)
        if cos is not None:
            c, s = cos.to(xf.dtype), sin.to(xf.dtype)
            h = x_hat.shape[-1] // 2
            # rope(x_hat * w) = x_hat * (w c) + rotate_half(x_hat * w) * s; the weight is folded into
            # the small (L, D) tables so no full-size u = x_hat * w is made. rotate_half(u) * s in
            # place on the half slices: y1 -= u2 s1, y2 += u1 s2.
            wc, ws1, ws2 = (c, s[..., :h], s[..., h:]) if w is None else (w * c, w[h:] * s[..., :h], w[:h] * s[..., h:])
            y = x_hat * wc
            y[..., :h].addcmul_(x_hat[..., h:], ws1, value=-1)
            y[..., h:].addcmul_(x_hat[..., :h], ws2)
        else:
            c = s = None
            y = x_hat if w is None else x_hat * w
        ctx.save_for_backward(x_hat, r, weight, c, s)
        ctx.x_dtype = x.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x_hat, r, weight, c, s = ctx.saved_tensors
        g = g.to(x_hat.dtype)
        own = c is not None  # gu is a buffer of ours (in-place updates allowed), not the incoming g
        if own:  # transpose of the rotation: du1 = g1 c1 + g2 s2, du2 = g2 c2 - g1 s1
            gu, h = g * c, g.shape[-1] // 2
            gu[..., :h].addcmul_(g[..., h:], s[..., h:])
            gu[..., h:].addcmul_(g[..., :h], s[..., :h], value=-1)
        else:
            gu = g
        need_w = weight is not None and ctx.needs_input_grad[1]
        if not (need_w or ctx.needs_input_grad[0]):
            return None, None, None, None, None
        prod = gu * x_hat  # dL/du * x_hat: the weight gradient's terms, then reused in place for dot
        grad_w = prod.sum(dim=tuple(range(gu.dim() - 1))).to(weight.dtype) if need_w else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            # d/dx of x * r(x) with dL/dx_hat = gu * w: r (gu w - x_hat * mean(gu w x_hat))
            if weight is not None:
                w = weight.to(gu.dtype)
                dot = prod.mul_(w).mean(-1, keepdim=True)
                gu, own = (gu.mul_(w) if own else gu * w), True
            else:
                dot = prod.mean(-1, keepdim=True)
            grad_x = gu.addcmul_(x_hat, dot, value=-1) if own else torch.addcmul(gu, x_hat, dot, value=-1)
            grad_x = grad_x.mul_(r).to(ctx.x_dtype)
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
    return mul_add(_per_sample(shift, x), x, 1 + _per_sample(scale, x))


def mul_add(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """base + a * b with broadcasting: torch.addcmul at value 1, the same forward bit for bit.
    Eager (not under torch.compile, plain tensors) it is one autograd node whose backward is
    grad * b and grad * a: addcmul's own backward multiplies by `value` first, one more
    full-size pass and buffer per call (in a DiT block: both adaLN modulates and both gated
    residuals). Only on CPU, where that pass is memory time; on a GPU it costs microseconds and
    a Python autograd node costs more host time than it saves (an eager DiT-B step on an H200,
    host-bound: 28 ms of host time per step in _MulAddBackward; 2026-12-04 profile)."""
    device = dispatch_device(base, a, b)
    if torch.compiler.is_compiling() or device is None or device.type != "cpu":
        return torch.addcmul(base, a, b)
    return _MulAdd.apply(base, a, b)


class _MulAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, base, a, b):
        need = ctx.needs_input_grad
        ctx.save_for_backward(b if need[1] else None, a if need[2] else None)
        ctx.shapes = base.shape, a.shape, b.shape
        return torch.addcmul(base, a, b)

    @staticmethod
    def backward(ctx, g):
        b, a = ctx.saved_tensors
        need, (base_shape, a_shape, b_shape) = ctx.needs_input_grad, ctx.shapes
        return (g.sum_to_size(base_shape) if need[0] else None,
                (g * b).sum_to_size(a_shape) if need[1] else None,
                (g * a).sum_to_size(b_shape) if need[2] else None)


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
