"""Fused RMSNorm / LayerNorm with optional affine and optional adaLN modulation, in Triton.

One forward and one backward kernel cover every variant through constexpr flags:
    xhat = (x - mean) * rstd            (RMS: x * rstd, no mean)
    z    = xhat * weight + bias         (each optional)
    y    = z * (1 + scale[g]) + shift[g] (optional; g = row // rows_per_group, i.e. the sample)
A row is loaded once into registers (BLOCK_D = next power of two >= D); statistics are fp32 for
every input dtype. The backward keeps per-program partial sums of dweight/dbias/dscale/dshift in
registers and writes one row of partials per program, reduced by torch afterwards: no atomics,
so results are deterministic run to run.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import new_output

MAX_D = 16384  # widest row held in registers; wider rows go to the torch path
SUPPORTED = f"fp32/bf16/fp16 tensors, last dim 1..{MAX_D}"


@triton.jit
def _norm_fwd(X, Y, W, B, SCALE, SHIFT, MEAN, RSTD, stride_x, stride_y, stride_sc, stride_sh,
              D, rows_per_group, eps,
              IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_MOD: tl.constexpr,
              BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / D
        xc = tl.where(mask, x - mean, 0.0)  # padded lanes must not enter the variance
        tl.store(MEAN + row, mean)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / D + eps)
    tl.store(RSTD + row, rstd)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_MOD:
        g = row // rows_per_group
        sc = tl.load(SCALE + g * stride_sc + cols, mask=mask, other=0.0).to(tl.float32)
        sh = tl.load(SHIFT + g * stride_sh + cols, mask=mask, other=0.0).to(tl.float32)
        y = y * (1.0 + sc) + sh
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd(X, DY, DX, W, B, SCALE, MEAN, RSTD, DW_PART, DB_PART, DSC_PART, DSH_PART,
              stride_x, stride_dy, stride_dx, stride_sc, D, rows_per_group, rows_per_prog,
              IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_MOD: tl.constexpr,
              BLOCK_D: tl.constexpr):
    # Program (g, s) owns rows [s * rows_per_prog, (s + 1) * rows_per_prog) of group g, so every
    # row it touches shares one scale/shift vector and dscale/dshift partials stay per group.
    g = tl.program_id(0)
    s = tl.program_id(1)
    part = g * tl.num_programs(1) + s
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    first = s * rows_per_prog
    n_rows = tl.minimum(rows_per_group - first, rows_per_prog)
    row0 = g.to(tl.int64) * rows_per_group + first
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        w = tl.full([BLOCK_D], 1.0, tl.float32)
    if HAS_B:
        b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        b = tl.zeros([BLOCK_D], tl.float32)
    if HAS_MOD:
        sc1 = 1.0 + tl.load(SCALE + g.to(tl.int64) * stride_sc + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        sc1 = tl.full([BLOCK_D], 1.0, tl.float32)
    acc_dw = tl.zeros([BLOCK_D], tl.float32)
    acc_db = tl.zeros([BLOCK_D], tl.float32)
    acc_dsc = tl.zeros([BLOCK_D], tl.float32)
    acc_dsh = tl.zeros([BLOCK_D], tl.float32)
    for i in range(0, n_rows):
        row = row0 + i
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        if IS_RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(mask, (x - tl.load(MEAN + row)) * rstd, 0.0)
        if HAS_MOD:
            acc_dsc += dy * (xhat * w + b)
            acc_dsh += dy
        dz = dy * sc1
        if HAS_W:
            acc_dw += dz * xhat
        if HAS_B:
            acc_db += dz
        dxhat = dz * w
        # d/dx of (x - mean) * rstd: remove the components along xhat (and the mean for LN).
        c1 = tl.sum(dxhat * xhat, axis=0) / D
        if IS_RMS:
            dx = (dxhat - xhat * c1) * rstd
        else:
            c2 = tl.sum(dxhat, axis=0) / D
            dx = (dxhat - xhat * c1 - c2) * rstd
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(DW_PART + part * D + cols, acc_dw, mask=mask)
    if HAS_B:
        tl.store(DB_PART + part * D + cols, acc_db, mask=mask)
    if HAS_MOD:
        tl.store(DSC_PART + part * D + cols, acc_dsc, mask=mask)
        tl.store(DSH_PART + part * D + cols, acc_dsh, mask=mask)


def _num_warps(block_d: int) -> int:
    # ~8 fp32 elements per thread per row vector: at 4096 the backward then needs ~110 registers
    # and no spills on sm_90 (8 warps: ~240 registers, one block per SM); from 8192 on the
    # 255-register cap of 32 warps makes the backward spill a little.
    return max(4, min(32, block_d // 256))


def _splits(groups: int, rows_per_group: int, device: torch.device) -> tuple[int, int]:
    """(programs per group, rows per program) for the backward: enough programs to fill the GPU
    a few times over, few enough that the partial-sum rows stay a small tensor."""
    if device.type == "cuda":
        target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 4  # interpreter: a few programs per group still exercises the split logic
    s = max(1, min(rows_per_group, triton.cdiv(target, groups)))
    per = triton.cdiv(rows_per_group, s)
    return triton.cdiv(rows_per_group, per), per


class NormFunction(torch.autograd.Function):
    """x (M, D) with unit column stride; weight/bias (D,) or None; scale/shift (G, D) or None with
    M = G * rows_per_group. Returns y (M, D) in out_dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, scale, shift, eps: float, rms: bool, rows_per_group: int,
                out_dtype: torch.dtype):
        m, d = x.shape
        block_d = triton.next_power_of_2(d)
        y = new_output((m, d), out_dtype, x.device)
        rstd = new_output((m,), torch.float32, x.device)
        mean = rstd if rms else new_output((m,), torch.float32, x.device)
        has_mod = scale is not None
        _norm_fwd[(m,)](
            x, y, weight if weight is not None else x, bias if bias is not None else x,
            scale if has_mod else x, shift if has_mod else x, mean, rstd,
            x.stride(0), y.stride(0), scale.stride(0) if has_mod else 0, shift.stride(0) if has_mod else 0,
            d, rows_per_group, eps,
            IS_RMS=rms, HAS_W=weight is not None, HAS_B=bias is not None, HAS_MOD=has_mod,
            BLOCK_D=block_d, num_warps=_num_warps(block_d))
        ctx.save_for_backward(x, weight, bias, scale, mean, rstd)
        ctx.rms, ctx.rows_per_group = rms, rows_per_group
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, scale, mean, rstd = ctx.saved_tensors
        m, d = x.shape
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        groups = m // ctx.rows_per_group
        n_split, per = _splits(groups, ctx.rows_per_group, x.device)
        n_part = groups * n_split
        dx = new_output((m, d), x.dtype, x.device)

        def part(flag):
            return new_output((n_part, d), torch.float32, x.device) if flag else rstd

        has_mod = scale is not None
        dw_p, db_p = part(weight is not None), part(bias is not None)
        dsc_p, dsh_p = part(has_mod), part(has_mod)
        block_d = triton.next_power_of_2(d)
        _norm_bwd[(groups, n_split)](
            x, dy, dx, weight if weight is not None else x, bias if bias is not None else x,
            scale if has_mod else x, mean, rstd, dw_p, db_p, dsc_p, dsh_p,
            x.stride(0), dy.stride(0), dx.stride(0), scale.stride(0) if has_mod else 0,
            d, ctx.rows_per_group, per,
            IS_RMS=ctx.rms, HAS_W=weight is not None, HAS_B=bias is not None, HAS_MOD=has_mod,
            BLOCK_D=block_d, num_warps=_num_warps(block_d))
        dw = dw_p.sum(0).to(weight.dtype) if weight is not None else None
        db = db_p.sum(0).to(bias.dtype) if bias is not None else None
        dsc = dsh = None
        if has_mod:
            dsc = dsc_p.view(groups, n_split, d).sum(1).to(scale.dtype)
            dsh = dsh_p.view(groups, n_split, d).sum(1).to(scale.dtype)
        return dx, dw, db, dsc, dsh, None, None, None, None


def _as_rows(x: torch.Tensor):
    """(rows (M, D) with unit column stride, function mapping a result rows tensor back to x's
    shape). Avoids a copy for views whose rows are dense in some other dim order, e.g. q/k heads
    (B, H, L, D) viewed from (B, L, H, D) memory: a row-wise op may walk rows in memory order."""
    d = x.shape[-1]
    if x.stride(-1) == 1:
        try:
            return x.view(-1, d), lambda y: y.view(x.shape)
        except RuntimeError:
            pass
        perm = sorted(range(x.dim() - 1), key=lambda i: -x.stride(i)) + [x.dim() - 1]
        xp = x.permute(perm)
        if xp.is_contiguous():
            inv = [perm.index(i) for i in range(x.dim())]
            return xp.view(-1, d), lambda y: y.view(xp.shape).permute(inv)
    return x.reshape(-1, d), lambda y: y.view(x.shape)


def _mod_rows(v: torch.Tensor, x: torch.Tensor):
    """scale/shift as (G, D) rows plus rows_per_group, or None when the broadcast is not one
    vector per sample ((B, D) / (B, 1, D) against x (B, N, D)) or one per token (x's shape)."""
    d = x.shape[-1]
    if v.shape == x.shape:
        rows = v.reshape(-1, d)
        return (rows if rows.stride(-1) == 1 else rows.contiguous()), 1
    if x.dim() == 3 and v.shape in ((x.shape[0], d), (x.shape[0], 1, d)):
        rows = v.reshape(x.shape[0], d)
        return (rows if rows.stride(-1) == 1 else rows.contiguous()), x.shape[1]
    return None


def _vec(v: torch.Tensor | None) -> torch.Tensor | None:
    return v if v is None or v.stride(-1) == 1 else v.contiguous()


def supports(x: torch.Tensor, *tensors: torch.Tensor | None) -> bool:
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    return (x.dtype in dtypes and 0 < x.shape[-1] <= MAX_D and x.numel() > 0
            and all(t is None or t.dtype in dtypes for t in tensors))


def norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, *,
         rms: bool) -> torch.Tensor:
    """RMSNorm (rms=True) or LayerNorm over the last dim of x, any shape."""
    rows, back = _as_rows(x)
    weight, bias = _vec(weight), _vec(bias)
    return back(NormFunction.apply(rows, weight, bias, None, None, eps, rms, rows.shape[0], x.dtype))


def norm_modulate(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                  shift: torch.Tensor, scale: torch.Tensor, eps: float, *, rms: bool = False):
    """norm(x) * (1 + scale) + shift in one pass; returns None when the scale/shift broadcast
    is not supported (the caller then uses the torch path)."""
    sc, sh = _mod_rows(scale, x), _mod_rows(shift, x)
    if sc is None or sh is None or sc[1] != sh[1]:
        return None
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    # Same result dtype as the torch path's type promotion (bf16 x with fp32 scale -> fp32).
    out_dtype = torch.promote_types(torch.promote_types(x.dtype, scale.dtype), shift.dtype)
    y = NormFunction.apply(rows, _vec(weight), _vec(bias), sc[0], sh[0], eps, rms, sc[1], out_dtype)
    return y.view(x.shape)
