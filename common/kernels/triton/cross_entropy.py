"""Triton row kernels for the chunked linear + cross-entropy of common/kernels/cross_entropy.py.

The chunk driver (an autograd.Function there) walks the vocabulary in slices: logits for one slice,
(T, Vc) in the hidden dtype, come from a cuBLAS matmul; these kernels then make one pass over them:
  forward: online softmax over BLOCK_V tiles of each row (running max + rescaled sum), continuing
           the state left by earlier slices, plus the target's logit when it falls in this
           slice. Nothing fp32 of size (T, Vc) is ever created.
  grad:    d logits = (softmax - onehot(target)) * g, written over the logits buffer in place
           (a separate buffer under MMP_KERNEL_POISON=1, so unwritten elements show up as NaN).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..backend import new_output


@triton.jit
def _ce_fwd_chunk(LOGITS, TGT, M_IN, M_OUT, S_IN, S_OUT, XT_IN, XT_OUT, stride_l, n_cols, v0, ignore_index,
                  BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_l
    # Online softmax over this slice's tiles, continuing the state (max m, sum s of exp(x - m))
    # of the slices before.
    m = tl.load(M_IN + row)
    s = tl.load(S_IN + row)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))  # finite: every tile holds at least one logit
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)  # m = -inf at first: s * 0
        m = m_new
    tl.store(M_OUT + row, m)
    tl.store(S_OUT + row, s)
    t = tl.load(TGT + row)
    local = t - v0
    inside = (local >= 0) & (local < n_cols) & (t != ignore_index)
    xt = tl.load(base + local, mask=inside, other=0.0).to(tl.float32)
    tl.store(XT_OUT + row, tl.load(XT_IN + row) + xt)


@triton.jit
def _ce_grad_chunk(LOGITS, OUT, TGT, M, LOG_S, G, stride_l, stride_o, n_cols, v0, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    m = tl.load(M + row)
    log_s = tl.load(LOG_S + row)
    g = tl.load(G + row)  # 0 for ignored targets: the whole row of the gradient is then 0
    local = tl.load(TGT + row) - v0
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        x = tl.load(LOGITS + row * stride_l + cols, mask=mask, other=0.0).to(tl.float32)
        d = tl.exp((x - m) - log_s) * g  # softmax as log_softmax forms it: x - m is near exact
        d = tl.where(cols == local, d - g, d)
        tl.store(OUT + row * stride_o + cols, d.to(OUT.dtype.element_ty), mask=mask)


def _block_v(n_cols: int, block_v: int | None) -> tuple[int, int]:
    bv = block_v or min(4096, triton.next_power_of_2(n_cols))
    return bv, (4 if bv <= 1024 else 8 if bv <= 4096 else 16)


class TritonChunkOps:
    """Per-slice forward/grad for ChunkedLinearCrossEntropy. block_v: tile width (None = auto;
    tests pass a small one so that rows span several tiles with a ragged last one)."""

    def __init__(self, block_v: int | None = None):
        self.block_v = block_v

    def forward_chunk(self, logits, targets, v0, m, s, xt, ignore_index):
        t, n = logits.shape
        # Under MMP_KERNEL_POISON the kernel writes fresh NaN-filled buffers instead of updating
        # the state in place, so a row it skips shows up.
        outs = [new_output(v.shape, v.dtype, v.device) if _poison() else v for v in (m, s, xt)]
        bv, warps = _block_v(n, self.block_v)
        _ce_fwd_chunk[(t,)](logits, targets, m, outs[0], s, outs[1], xt, outs[2], logits.stride(0), n, v0,
                            ignore_index, BLOCK_V=bv, num_warps=warps)
        for state, out in zip((m, s, xt), outs):
            if out is not state:
                state.copy_(out)

    def grad_chunk(self, logits, targets, v0, m, log_s, g, ignore_index):
        t, n = logits.shape
        out = new_output(logits.shape, logits.dtype, logits.device) if _poison() else logits
        bv, warps = _block_v(n, self.block_v)
        _ce_grad_chunk[(t,)](logits, out, targets, m, log_s, g, logits.stride(0), out.stride(0), n, v0,
                             BLOCK_V=bv, num_warps=warps)
        return out


def _poison() -> bool:
    return os.environ.get("MMP_KERNEL_POISON", "0") not in ("", "0")


SUPPORTED = "fp32/bf16/fp16 hidden and weight"


def supports(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    return hidden.dtype in dtypes and weight.dtype in dtypes and hidden.numel() > 0
