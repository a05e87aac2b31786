"""SwiGLU gate in Triton: y = silu(a) * b, fp32 math, one read of a and b, one write of y.

Backward: with s = sigmoid(a),  da = dy * b * s * (1 + a (1 - s)),  db = dy * a * s.
a and b are addressed through their row strides, so the two halves of a fused [a | b]
projection are read without a copy, and in the fused form (swiglu(x) on x = [a | b]) the
backward writes da and db straight into the two halves of one dx buffer.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import new_output

BLOCK = 1024


@triton.jit
def _swiglu_fwd(A, B, Y, N, sa, sb, sy, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    a = tl.load(A + row * sa + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + row * sb + cols, mask=mask, other=0.0).to(tl.float32)
    y = a * tl.sigmoid(a) * b
    tl.store(Y + row * sy + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(A, B, DY, DA, DB, N, sa, sb, sdy, sda, sdb, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    a = tl.load(A + row * sa + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + row * sb + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * sdy + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(a)
    silu = a * s
    da = dy * b * (s + silu * (1.0 - s))
    db = dy * silu
    tl.store(DA + row * sda + cols, da.to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + row * sdb + cols, db.to(DB.dtype.element_ty), mask=mask)


def _grid(m: int, n: int):
    return (m, triton.cdiv(n, BLOCK))


def _fwd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    m, n = a.shape
    y = new_output((m, n), a.dtype, a.device)
    _swiglu_fwd[_grid(m, n)](a, b, y, n, a.stride(0), b.stride(0), y.stride(0), BLOCK=BLOCK, num_warps=4)
    return y


def _bwd(a, b, dy, da, db) -> None:
    m, n = a.shape
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    _swiglu_bwd[_grid(m, n)](a, b, dy, da, db, n, a.stride(0), b.stride(0), dy.stride(0), da.stride(0),
                             db.stride(0), BLOCK=BLOCK, num_warps=4)


class SwiGLUFunction(torch.autograd.Function):
    """a, b (M, N), unit column stride, any row strides."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return _fwd(a, b)

    @staticmethod
    def backward(ctx, dy):
        a, b = ctx.saved_tensors
        da = new_output(a.shape, a.dtype, a.device)
        db = new_output(b.shape, b.dtype, b.device)
        _bwd(a, b, dy, da, db)
        return da, db


class FusedSwiGLUFunction(torch.autograd.Function):
    """x (M, 2N) = [a | b] -> (M, N); the backward fills one (M, 2N) gradient."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        n = x.shape[1] // 2
        return _fwd(x[:, :n], x[:, n:])

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        n = x.shape[1] // 2
        dx = new_output(x.shape, x.dtype, x.device)
        _bwd(x[:, :n], x[:, n:], dy, dx[:, :n], dx[:, n:])
        return dx


def _rows(t: torch.Tensor) -> torch.Tensor:
    """2-D (rows, last dim) view with unit column stride; copies only when no such view exists."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


SUPPORTED = "fp32/bf16/fp16 a and b of one shape and dtype"


def supports(*tensors: torch.Tensor) -> bool:
    t0 = tensors[0]
    return (t0.numel() > 0 and t0.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and all(t.dtype == t0.dtype and t.shape == t0.shape for t in tensors))


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return SwiGLUFunction.apply(_rows(a), _rows(b)).view(a.shape)


def swiglu_fused(x: torch.Tensor) -> torch.Tensor:
    return FusedSwiGLUFunction.apply(_rows(x)).view(*x.shape[:-1], x.shape[-1] // 2)
