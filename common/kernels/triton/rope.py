"""Rotate-half RoPE in Triton: y = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1].

Per channel pair (i, i + D/2):  y1 = x1 c1 - x2 s1,  y2 = x2 c2 + x1 s2.
The backward is the transposed map (the inverse rotation when c1 = c2, s1 = s2, as RoPE tables
are):  dx1 = dy1 c1 + dy2 s2,  dx2 = dy2 c2 - dy1 s1; the same kernel with BACKWARD=True.
x is addressed through its (B, H, L) strides, so the (B, H, L, D) head view of a (B, L, H, D)
projection is rotated in place of a copy, and the output keeps x's memory layout.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import new_output_like


@triton.jit
def _rope_kernel(X, Y, COS, SIN, n_rows, H, L, sxb, sxh, sxl, syb, syh, syl, s_cos, s_sin, HALF,
                 BACKWARD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    pos = rows % L
    bh = rows // L
    h = bh % H
    b = bh // H
    cols = tl.arange(0, BLOCK_H)
    mask = rmask[:, None] & (cols < HALF)[None, :]
    px = X + (b * sxb + h * sxh + pos * sxl)[:, None] + cols[None, :]
    py = Y + (b * syb + h * syh + pos * syl)[:, None] + cols[None, :]
    pc = COS + (pos * s_cos)[:, None] + cols[None, :]
    ps = SIN + (pos * s_sin)[:, None] + cols[None, :]
    x1 = tl.load(px, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(px + HALF, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(pc, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(pc + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(ps, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(ps + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(py, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(py + HALF, y2.to(Y.dtype.element_ty), mask=mask)


def config(d: int) -> tuple[int, int, int]:
    """(rows per program, half-width block, warps): ~2048 pairs per program, ~8 per thread
    (16 per thread needed ~180 registers on sm_90, capping occupancy for a memory-bound op)."""
    block_h = triton.next_power_of_2(d // 2)
    block_r = max(1, min(64, 2048 // block_h))
    return block_r, block_h, max(1, min(8, block_r * block_h // 256))


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    bsz, h, l, d = x.shape
    y = new_output_like(x)  # keeps x's layout when dense; the kernel takes y's strides anyway
    n_rows = bsz * h * l
    block_r, block_h, warps = config(d)
    _rope_kernel[(triton.cdiv(n_rows, block_r),)](
        x, y, cos, sin, n_rows, h, l, *x.stride()[:3], *y.stride()[:3], cos.stride(0), sin.stride(0),
        d // 2, BACKWARD=backward, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=warps)
    return y


class RopeFunction(torch.autograd.Function):
    """x (B, H, L, D) with unit last stride; cos/sin (L, D) with unit last stride, no grad."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _launch(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        return _launch(dy, cos, sin, backward=True), None, None


def _table(t: torch.Tensor, l: int, d: int) -> torch.Tensor | None:
    while t.dim() > 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 2 or t.shape != (l, d) or t.requires_grad:
        return None
    return t if t.stride(-1) == 1 else t.contiguous()


SUPPORTED = "x (B, H, L, D) fp32/bf16/fp16 with even D, cos/sin (L, D) without grad"


def supports(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return (x.dim() == 4 and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and x.shape[-1] % 2 == 0 and x.numel() > 0
            and _table(cos, *x.shape[2:]) is not None and _table(sin, *x.shape[2:]) is not None)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Caller checks supports(x, cos, sin) first."""
    l, d = x.shape[2:]
    if x.stride(-1) != 1:
        x = x.contiguous()
    return RopeFunction.apply(x, _table(cos, l, d), _table(sin, l, d))
