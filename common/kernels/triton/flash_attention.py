"""FlashAttention-2 style Triton kernels: forward with LSE, backward, GQA, varlen, causal.

Layouts (any strides, last dim contiguous):
  dense:  q (B, H, Lq, D), k/v (B, Hkv, Lk, D); lse (B, H, Lq) fp32
  varlen: q (total_q, H, D), k/v (total_k, Hkv, D) with int32 cu_seqlens_q/k (B + 1,); lse (H, total_q)
Causal masking is bottom-right aligned per sequence: key j is visible to query i iff
j <= i + (Lk - Lq). Rows with no visible key give out = 0 and lse = -inf (ring attention treats
them as empty blocks). lse is natural log of sum(exp(scale * q.k)).

The kernels run natively on CUDA, and on CPU tensors when TRITON_INTERPRET=1 was set before
triton was imported (how the CPU test checks numerics). Setting env MMP_KERNEL_POISON=1 fills
every buffer the kernels allocate with NaN first, so an element a kernel forgets to write shows up.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# Tile sizes per (pass, head-dim bound, element size): (BLOCK_M, BLOCK_N, num_warps, num_stages).
# Chosen so that ptxas (sm_90) reports no register spills, except small ones in the bf16 D=256
# and fp32 D=128 forwards; not yet timed on a GPU (a benchmark should, and update this table).
# The interpreter uses small uneven tiles (see _config) so the CPU test crosses several tiles,
# partial tiles and M != N causal boundaries.
BLOCKS = {
    # forward: q tile of BLOCK_M rows stays in registers while K/V tiles stream through.
    ("fwd", 64, 2): (128, 64, 4, 3), ("fwd", 128, 2): (128, 64, 8, 3), ("fwd", 256, 2): (64, 32, 8, 2),
    # dk/dv: a K/V tile of BLOCK_N rows holds two fp32 accumulators, q tiles (BLOCK_M) stream.
    ("dkdv", 64, 2): (32, 128, 8, 2), ("dkdv", 128, 2): (64, 64, 8, 2), ("dkdv", 256, 2): (16, 32, 4, 1),
    # dq: a q tile of BLOCK_M rows, K/V tiles (BLOCK_N) stream.
    ("dq", 64, 2): (128, 32, 8, 2), ("dq", 128, 2): (64, 32, 4, 2), ("dq", 256, 2): (32, 32, 8, 1),
    # fp32 inputs use exact fp32 products (FMA, no tensor cores): smaller tiles, no register spills
    # (checked with ptxas for sm_90). A slow path for tests and debugging; training runs in bf16.
    ("fwd", 64, 4): (64, 32, 8, 1), ("fwd", 128, 4): (32, 32, 8, 1), ("fwd", 256, 4): (16, 16, 4, 1),
    ("dkdv", 64, 4): (32, 64, 8, 1), ("dkdv", 128, 4): (16, 64, 8, 1), ("dkdv", 256, 4): (16, 32, 8, 1),
    ("dq", 64, 4): (64, 32, 8, 1), ("dq", 128, 4): (32, 32, 4, 1), ("dq", 256, 4): (16, 32, 4, 1),
}
INTERPRETER_BLOCKS = {"fwd": (32, 16), "dkdv": (16, 32), "dq": (32, 16)}
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreted() -> bool:
    """True when triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(_fwd_kernel, InterpretedFunction)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """None when these tensors can run here, else the reason they cannot."""
    d = q.shape[-1]
    if q.device.type != "cuda" and not (q.device.type == "cpu" and interpreted()):
        return f"triton attention needs CUDA tensors (or TRITON_INTERPRET=1 for CPU), got {q.device}"
    if not (q.dtype == k.dtype == v.dtype and q.dtype in SUPPORTED_DTYPES):
        return f"triton attention needs q, k, v of one dtype in {SUPPORTED_DTYPES}"
    if d < 16 or d > 256 or d & (d - 1) or k.shape[-1] != d or v.shape[-1] != d:
        return f"triton attention needs one power-of-two head dim in [16, 256], got {d}"
    return None


def _poison() -> bool:
    return os.environ.get("MMP_KERNEL_POISON", "0") not in ("", "0")


def _empty_like(x: torch.Tensor, dtype=None) -> torch.Tensor:
    out = torch.empty_like(x, dtype=dtype)
    return out.fill_(float("nan")) if _poison() else out


def _empty(shape, device) -> torch.Tensor:
    out = torch.empty(shape, device=device, dtype=torch.float32)
    return out.fill_(float("nan")) if _poison() else out


def _config(kind: str, d: int, dtype: torch.dtype):
    if interpreted():
        return (*INTERPRETER_BLOCKS[kind], 1, 1)
    dbound = 64 if d <= 64 else (128 if d <= 128 else 256)
    return BLOCKS[(kind, dbound, 4 if dtype == torch.float32 else 2)]


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _bounds(cu_ptr, b, dense_len, IS_VARLEN: tl.constexpr):
    """(first token, length) of sequence b: from cu_seqlens for varlen, (0, dense_len) otherwise."""
    if IS_VARLEN:
        start = tl.load(cu_ptr + b)
        length = tl.load(cu_ptr + b + 1) - start
    else:
        start = b * 0
        length = b * 0 + dense_len
    return start, length


@triton.jit
def _off(b, h, start, stride_b, stride_h, stride_m):
    """Element offset of (batch b, head h, token start); int64 so that large packed batches
    (total tokens * H * D > 2**31) stay addressable."""
    return b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + start.to(tl.int64) * stride_m


@triton.jit
def _fwd_tiles(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, rows, lo, hi, k_len, diag, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
               PRECISION: tl.constexpr):
    cols0 = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + cols0
        if MASKED:
            kt = tl.load(k_base + cols[None, :] * stride_kn + dims[:, None], mask=cols[None, :] < k_len, other=0.0)
            vt = tl.load(v_base + cols[:, None] * stride_vn + dims[None, :], mask=cols[:, None] < k_len, other=0.0)
        else:
            kt = tl.load(k_base + cols[None, :] * stride_kn + dims[:, None])
            vt = tl.load(v_base + cols[:, None] * stride_vn + dims[None, :])
        # scores in log2 units: exp2 is the native instruction, scale*log2(e) folded into one multiply.
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        if MASKED:
            ok = cols[None, :] < k_len
            if CAUSAL:
                ok = ok & (cols[None, :] <= rows[:, None] + diag)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            # A row with no visible key so far keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new
        alpha = tl.exp2(m_i - m_new_safe)
        p = tl.exp2(s - m_new_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k"])
def _fwd_kernel(Q, K, V, O, LSE, CU_Q, CU_K, qk_scale,
                stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
                seqlen_q, seqlen_k, group,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len = _bounds(CU_Q, b, seqlen_q, IS_VARLEN)
    k_start, k_len = _bounds(CU_K, b, seqlen_k, IS_VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:  # grid covers the longest sequence of the pack
        return
    hk = h // group  # GQA: read the shared kv head in place, never materialise the repeat
    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows[:, None] < q_len
    q_base = Q + _off(b, h, q_start, stride_qb, stride_qh, stride_qm)
    q = tl.load(q_base + rows[:, None] * stride_qm + dims[None, :], mask=row_ok, other=0.0)
    k_base = K + _off(b, hk, k_start, stride_kb, stride_kh, stride_kn)
    v_base = V + _off(b, hk, k_start, stride_vb, stride_vh, stride_vn)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    diag = k_len - q_len
    if CAUSAL:
        # Keys past the last row's diagonal are masked for the whole tile; keys before the first
        # row's diagonal are visible to every row, so those tiles skip the mask arithmetic.
        hi = tl.maximum(tl.minimum(start_m + BLOCK_M + diag, k_len), 0)
        full = tl.maximum(tl.minimum(start_m + 1 + diag, k_len), 0)
    else:
        hi = k_len
        full = k_len
    full = (full // BLOCK_N) * BLOCK_N
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, rows, 0, full, k_len,
                               diag, qk_scale, HEAD_DIM, BLOCK_N, CAUSAL, False, PRECISION)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, rows, full, hi, k_len,
                               diag, qk_scale, HEAD_DIM, BLOCK_N, CAUSAL, True, PRECISION)

    empty = l_i == 0.0  # no visible key: out 0, lse -inf
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    o_base = O + _off(b, h, q_start, stride_ob, stride_oh, stride_om)
    tl.store(o_base + rows[:, None] * stride_om + dims[None, :], out.to(O.dtype.element_ty), mask=row_ok)
    l_base = LSE + _off(b, h, q_start, stride_lb, stride_lh, 1)
    tl.store(l_base + rows, lse, mask=rows < q_len)


@triton.jit(do_not_specialize=["seqlen_q"])
def _bwd_preprocess(O, DO, DLSE, DELTA, CU_Q,
                    stride_ob, stride_oh, stride_om, stride_db, stride_dh, stride_dm, stride_lb, stride_lh,
                    seqlen_q,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr,
                    HAS_DLSE: tl.constexpr):
    # delta_i = sum_d dO*O = sum_j P_ij dP_ij, the softmax-backward row term. A gradient flowing
    # into lse (ring-attention merges) adds dlse_i * P_ij to dS_ij, i.e. delta_i -= dlse_i.
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len = _bounds(CU_Q, b, seqlen_q, IS_VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return
    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    ok = rows < q_len
    o = tl.load(O + _off(b, h, q_start, stride_ob, stride_oh, stride_om) + rows[:, None] * stride_om
                + dims[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + _off(b, h, q_start, stride_db, stride_dh, stride_dm) + rows[:, None] * stride_dm
                 + dims[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    l_off = _off(b, h, q_start, stride_lb, stride_lh, 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + l_off + rows, mask=ok, other=0.0)
    tl.store(DELTA + l_off + rows, delta, mask=ok)


# Backward design: dK/dV and dQ are two kernels. dK/dV owns one K/V tile (and, for GQA, loops over
# every query head of its group, so the group sum happens in registers with no atomics); dQ owns
# one query tile. Fusing dQ into the dK/dV kernel needs fp32 atomic adds into a zeroed buffer: they
# make results run-to-run nondeterministic, contend when many K/V tiles hit one query tile, and
# need a zero-fill + cast pass. Two kernels recompute QK^T and P once more (about 20% more FLOPs
# in the backward) but write each gradient element exactly once, deterministically.
# Masks are applied on every backward tile (not split like the forward): the backward is bound by
# its five matmuls, and one code path keeps it simpler to verify.

@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k"])
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K, qk_scale, sm_scale,
                     stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                     stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm,
                     stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                     stride_lb, stride_lh,
                     seqlen_q, seqlen_k, group,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len = _bounds(CU_Q, b, seqlen_q, IS_VARLEN)
    k_start, k_len = _bounds(CU_K, b, seqlen_k, IS_VARLEN)
    start_n = pid_n * BLOCK_N
    if start_n >= k_len:
        return
    cols = start_n + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    col_ok = cols[:, None] < k_len
    k = tl.load(K + _off(b, hk, k_start, stride_kb, stride_kh, stride_kn) + cols[:, None] * stride_kn
                + dims[None, :], mask=col_ok, other=0.0)
    v = tl.load(V + _off(b, hk, k_start, stride_vb, stride_vh, stride_vn) + cols[:, None] * stride_vn
                + dims[None, :], mask=col_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    diag = k_len - q_len
    lo = 0
    if CAUSAL:
        # The first query row that sees key start_n is start_n - diag; earlier q tiles are all masked.
        lo = (tl.maximum(start_n - diag, 0) // BLOCK_M) * BLOCK_M
    rows0 = tl.arange(0, BLOCK_M)
    # Work on transposed tiles (keys x queries) so the P^T and dS^T products need no transposes.
    for g in range(0, group):
        h = hk * group + g
        q_base = Q + _off(b, h, q_start, stride_qb, stride_qh, stride_qm)
        do_base = DO + _off(b, h, q_start, stride_db, stride_dh, stride_dm)
        l_off = _off(b, h, q_start, stride_lb, stride_lh, 1)
        for start_m in range(lo, q_len, BLOCK_M):
            rows = start_m + rows0
            row_ok = rows < q_len
            qt = tl.load(q_base + rows[None, :] * stride_qm + dims[:, None], mask=row_ok[None, :], other=0.0)
            do = tl.load(do_base + rows[:, None] * stride_dm + dims[None, :], mask=row_ok[:, None], other=0.0)
            lse = tl.load(LSE + l_off + rows, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + l_off + rows, mask=row_ok, other=0.0)
            # Rows with no visible key have lse = -inf; every entry of theirs is masked below anyway.
            lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
            st = tl.dot(k, qt, input_precision=PRECISION) * qk_scale
            ok = row_ok[None, :] & col_ok
            if CAUSAL:
                ok = ok & (cols[:, None] <= rows[None, :] + diag)
            pt = tl.where(ok, tl.exp2(st - lse2[None, :]), 0.0)
            dv += tl.dot(pt.to(do.dtype), do, input_precision=PRECISION)
            dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            dst = pt * (dpt - delta[None, :])
            dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), input_precision=PRECISION)
    dk *= sm_scale
    tl.store(DK + _off(b, hk, k_start, stride_dkb, stride_dkh, stride_dkn) + cols[:, None] * stride_dkn
             + dims[None, :], dk.to(DK.dtype.element_ty), mask=col_ok)
    tl.store(DV + _off(b, hk, k_start, stride_dvb, stride_dvh, stride_dvn) + cols[:, None] * stride_dvn
             + dims[None, :], dv.to(DV.dtype.element_ty), mask=col_ok)


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k"])
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K, qk_scale, sm_scale,
                   stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                   stride_vb, stride_vh, stride_vn, stride_db, stride_dh, stride_dm,
                   stride_dqb, stride_dqh, stride_dqm, stride_lb, stride_lh,
                   seqlen_q, seqlen_k, group,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, q_len = _bounds(CU_Q, b, seqlen_q, IS_VARLEN)
    k_start, k_len = _bounds(CU_K, b, seqlen_k, IS_VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return
    hk = h // group
    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < q_len
    q = tl.load(Q + _off(b, h, q_start, stride_qb, stride_qh, stride_qm) + rows[:, None] * stride_qm
                + dims[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + _off(b, h, q_start, stride_db, stride_dh, stride_dm) + rows[:, None] * stride_dm
                 + dims[None, :], mask=row_ok[:, None], other=0.0)
    l_off = _off(b, h, q_start, stride_lb, stride_lh, 1)
    lse = tl.load(LSE + l_off + rows, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + l_off + rows, mask=row_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
    k_base = K + _off(b, hk, k_start, stride_kb, stride_kh, stride_kn)
    v_base = V + _off(b, hk, k_start, stride_vb, stride_vh, stride_vn)
    diag = k_len - q_len
    hi = k_len
    if CAUSAL:
        hi = tl.maximum(tl.minimum(start_m + BLOCK_M + diag, k_len), 0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    cols0 = tl.arange(0, BLOCK_N)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + cols0
        col_ok = cols < k_len
        kt = tl.load(k_base + cols[None, :] * stride_kn + dims[:, None], mask=col_ok[None, :], other=0.0)
        vt = tl.load(v_base + cols[None, :] * stride_vn + dims[:, None], mask=col_ok[None, :], other=0.0)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        ok = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            ok = ok & (cols[None, :] <= rows[:, None] + diag)
        p = tl.where(ok, tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, vt, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=PRECISION)
    dq *= sm_scale
    tl.store(DQ + _off(b, h, q_start, stride_dqb, stride_dqh, stride_dqm) + rows[:, None] * stride_dqm
             + dims[None, :], dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


# ----------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------

def _strides(x: torch.Tensor, varlen: bool):
    """(batch, head, token) strides; varlen tensors have no batch dim (sequence starts come from cu)."""
    return (0, x.stride(1), x.stride(0)) if varlen else (x.stride(0), x.stride(1), x.stride(2))


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class _Geometry:
    """Shapes shared by the forward and backward launches."""

    def __init__(self, q, k, cu_q, cu_k, max_q, max_k):
        self.varlen = cu_q is not None
        if self.varlen:
            self.batch = cu_q.numel() - 1
            self.heads, self.kv_heads, self.d = q.shape[1], k.shape[1], q.shape[2]
            self.seqlen_q, self.seqlen_k = max_q, max_k
            self.lse_shape = (self.heads, q.shape[0])
        else:
            self.batch, self.heads, self.seqlen_q, self.d = q.shape
            self.kv_heads, self.seqlen_k = k.shape[1], k.shape[2]
            self.lse_shape = (self.batch, self.heads, self.seqlen_q)
        self.group = self.heads // self.kv_heads

    def lse_strides(self, lse):
        return (0, lse.stride(0)) if self.varlen else (lse.stride(0), lse.stride(1))


def _precision(dtype):
    # fp32 inputs get true fp32 products (the tests hold them to the fp32 torch reference); 16-bit
    # inputs use tensor cores regardless of this flag.
    return "ieee" if dtype == torch.float32 else "tf32"


def _forward(q, k, v, causal, scale, cu_q, cu_k, max_q, max_k):
    g = _Geometry(q, k, cu_q, cu_k, max_q, max_k)
    o = _empty_like(q)
    lse = _empty(g.lse_shape, q.device)
    bm, bn, warps, stages = _config("fwd", g.d, q.dtype)
    cu_q_arg = cu_q if g.varlen else lse  # unused pointer when dense
    cu_k_arg = cu_k if g.varlen else lse
    grid = (triton.cdiv(g.seqlen_q, bm), g.heads, g.batch)
    if min(grid) > 0:
        _fwd_kernel[grid](q, k, v, o, lse, cu_q_arg, cu_k_arg, scale * LOG2E,
                          *_strides(q, g.varlen), *_strides(k, g.varlen), *_strides(v, g.varlen),
                          *_strides(o, g.varlen), *g.lse_strides(lse),
                          g.seqlen_q, g.seqlen_k, g.group,
                          HEAD_DIM=g.d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, IS_VARLEN=g.varlen,
                          PRECISION=_precision(q.dtype), num_warps=warps, num_stages=stages)
    return o, lse


def _backward(do, dlse, q, k, v, o, lse, causal, scale, cu_q, cu_k, max_q, max_k):
    g = _Geometry(q, k, cu_q, cu_k, max_q, max_k)
    do = _last_contiguous(do)
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    delta = _empty(g.lse_shape, q.device)
    dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)
    cu_q_arg = cu_q if g.varlen else lse
    cu_k_arg = cu_k if g.varlen else lse
    if min(g.batch, g.heads, g.seqlen_q, g.seqlen_k) == 0:  # nothing attends: zero gradients
        return dq.zero_(), dk.zero_(), dv.zero_()
    prec = _precision(q.dtype)
    bm = _config("fwd", g.d, q.dtype)[0]
    _bwd_preprocess[(triton.cdiv(g.seqlen_q, bm), g.heads, g.batch)](
        o, do, dlse if dlse is not None else delta, delta, cu_q_arg,
        *_strides(o, g.varlen), *_strides(do, g.varlen), *g.lse_strides(delta), g.seqlen_q,
        HEAD_DIM=g.d, BLOCK_M=bm, IS_VARLEN=g.varlen, HAS_DLSE=dlse is not None)
    common = dict(HEAD_DIM=g.d, CAUSAL=causal, IS_VARLEN=g.varlen, PRECISION=prec)
    bm, bn, warps, stages = _config("dkdv", g.d, q.dtype)
    _bwd_dkdv_kernel[(triton.cdiv(g.seqlen_k, bn), g.kv_heads, g.batch)](
        q, k, v, do, lse, delta, dk, dv, cu_q_arg, cu_k_arg, scale * LOG2E, scale,
        *_strides(q, g.varlen), *_strides(k, g.varlen), *_strides(v, g.varlen), *_strides(do, g.varlen),
        *_strides(dk, g.varlen), *_strides(dv, g.varlen), *g.lse_strides(lse),
        g.seqlen_q, g.seqlen_k, g.group, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **common)
    bm, bn, warps, stages = _config("dq", g.d, q.dtype)
    _bwd_dq_kernel[(triton.cdiv(g.seqlen_q, bm), g.heads, g.batch)](
        q, k, v, do, lse, delta, dq, cu_q_arg, cu_k_arg, scale * LOG2E, scale,
        *_strides(q, g.varlen), *_strides(k, g.varlen), *_strides(v, g.varlen), *_strides(do, g.varlen),
        *_strides(dq, g.varlen), *g.lse_strides(lse),
        g.seqlen_q, g.seqlen_k, g.group, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages, **common)
    return dq, dk, dv


class FlashAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, cu_q, cu_k, max_q, max_k):
        q, k, v = (_last_contiguous(t) for t in (q, k, v))
        o, lse = _forward(q, k, v, causal, scale, cu_q, cu_k, max_q, max_k)
        ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
        ctx.args = (causal, scale, max_q, max_k)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
        causal, scale, max_q, max_k = ctx.args
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = _backward(do, dlse, q, k, v, o, lse, causal, scale, cu_q, cu_k, max_q, max_k)
        return dq, dk, dv, None, None, None, None, None, None


def _check(q, k, v, varlen):
    reason = supports(q, k, v)
    if reason:
        raise ValueError(reason)
    nd = 3 if varlen else 4
    if q.dim() != nd or k.dim() != nd or v.dim() != nd:
        raise ValueError(f"triton attention expects {nd}-D q, k, v")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    hq, hkv = q.shape[-2 if varlen else 1], k.shape[-2 if varlen else 1]
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")


def flash_attention(q, k, v, *, causal: bool = False, scale: float | None = None):
    """q (B, H, Lq, D), k/v (B, Hkv, Lk, D) -> (out like q, lse (B, H, Lq) fp32). Differentiable
    in q, k, v, including through lse."""
    _check(q, k, v, varlen=False)
    if q.shape[0] != k.shape[0]:
        raise ValueError("q and k batch sizes differ")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return FlashAttentionFn.apply(q, k, v, bool(causal), scale, None, None, None, None)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                           causal: bool = False, scale: float | None = None):
    """Packed sequences: q (total_q, H, D), k/v (total_k, Hkv, D), cu_seqlens (B + 1,) int32 offsets.
    Returns (out (total_q, H, D), lse (H, total_q) fp32). max_seqlen_* are computed when None
    (a device sync; pass them in a training loop)."""
    _check(q, k, v, varlen=True)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError("cu_seqlens_q and cu_seqlens_k must describe the same number of sequences")
    cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32).contiguous()
    cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32).contiguous()
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_q[1:] - cu_q[:-1]).max()) if cu_q.numel() > 1 else 0
    if max_seqlen_k is None:
        max_seqlen_k = int((cu_k[1:] - cu_k[:-1]).max()) if cu_k.numel() > 1 else 0
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return FlashAttentionFn.apply(q, k, v, bool(causal), scale, cu_q, cu_k, int(max_seqlen_q), int(max_seqlen_k))
