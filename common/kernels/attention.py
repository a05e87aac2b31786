"""Attention dispatch: the single entry point models use for softmax attention.

Shapes: q (B, H, Lq, D); k, v (B, Hkv, Lk, D) with H a multiple of Hkv (GQA: query head h reads
kv head h // (H // Hkv)). attn_mask: bool (True = may attend) or additive float, broadcastable
to (B, H, Lq, Lk). causal=True masks key j for query i when j > i + (Lk - Lq): bottom-right
aligned (flash-attn convention), which equals SDPA's is_causal when Lq == Lk and is what a query
block at the end of a longer key sequence (decoding, ring blocks) needs.

Packed variable-length batches (flash-attn's varlen layout): q (total_q, H, D), k/v (total_k, Hkv, D)
with cu_seqlens_q/k int32 (B + 1,) cumulative offsets; sequence b is q[cu_q[b]:cu_q[b+1]] and
attends only to its own keys (causal per sequence). lse is then (H, total_q).

Fully masked query rows: the LSE/reference/triton paths return out = 0 and lse = -inf (so ring
attention merges them as empty blocks) with zero gradients; the SDPA path leaves them undefined
(NaN), so callers such as CrossAttention guarantee at least one valid key.

Backends: "reference" (explicit math, differentiable through lse), "torch" (SDPA; the math path
when lse is asked for; a per-sequence loop for varlen), "triton" (common/kernels/triton/
flash_attention.py: FlashAttention-2 forward/backward with GQA, varlen and a differentiable lse;
no attn_mask), "flash_attn" (the flash-attn package, FA3 then FA2, CUDA fp16/bf16; its lse
carries no gradient). "auto" takes the first backend of AUTO_PREFERENCE that supports the call.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .backend import dispatch_device, requested_backend, triton_available, triton_interpreting

# "auto" tries these in order, per device type and per kind of call; the first backend that
# supports the arguments wins ("reference" takes anything and is the last resort). The GPU
# benchmark (bench/) owns the "cuda" row: SDPA (cuDNN/flash) is the default for plain attention,
# and our Triton kernel wherever SDPA cannot serve the call (an lse for ring attention, packed
# varlen batches). flash_attn is absent from the lse rows because its lse carries no gradient.
AUTO_PREFERENCE: dict[str, dict[str, tuple[str, ...]]] = {
    "cuda": {"plain": ("torch",), "lse": ("triton", "reference"),
             "varlen": ("triton", "flash_attn", "torch"), "varlen_lse": ("triton", "reference")},
    # CPU, other devices, and tensor subclasses (DTensor), which must stay on torch ops.
    "default": {"plain": ("torch",), "lse": ("reference",), "varlen": ("torch",), "varlen_lse": ("reference",)},
}


def _expand_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    hkv = x.shape[1]
    if n_heads % hkv:
        raise ValueError(f"query heads {n_heads} not a multiple of kv heads {hkv}")
    return x if hkv == n_heads else x.repeat_interleave(n_heads // hkv, dim=1)


def _combined_bias(lq, lk, causal, attn_mask, device, dtype):
    """Additive bias (or None) combining the causal and user masks, in `dtype`."""
    bias = None
    if causal:
        i = torch.arange(lq, device=device)[:, None]
        j = torch.arange(lk, device=device)[None, :]
        bias = torch.zeros(lq, lk, device=device, dtype=dtype).masked_fill(j > i + (lk - lq), -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            m = torch.zeros(attn_mask.shape, device=device, dtype=dtype).masked_fill(~attn_mask, -math.inf)
        else:
            m = attn_mask.to(dtype)
        bias = m if bias is None else bias + m
    return bias


def _math_attention(q, k, v, causal, attn_mask, scale, compute_dtype):
    """Explicit softmax attention in compute_dtype; returns (out, lse), both in compute_dtype."""
    h = q.shape[1]
    k, v = _expand_kv(k, h), _expand_kv(v, h)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qc, kc, vc = (t.to(compute_dtype) for t in (q, k, v))
    s = torch.matmul(qc, kc.transpose(-1, -2)) * scale
    bias = _combined_bias(q.shape[2], k.shape[2], causal, attn_mask, q.device, compute_dtype)
    if bias is not None:
        s = s + bias
    # Softmax by hand rather than through logsumexp, whose backward is NaN on fully masked rows
    # (exp(-inf - -inf)) and would poison every gradient. The shift m carries no gradient (the
    # softmax and lse do not depend on it). Empty rows get a row sum of 1 instead of 0: out 0,
    # lse -inf, zero gradients. (Not clamp_min(1): a row with one visible key sums to exactly 1,
    # and clamp's backward at the boundary would drop its gradient.)
    m = s.detach().amax(-1, keepdim=True) if s.shape[-1] else s.new_full((*s.shape[:-1], 1), -math.inf)
    empty = torch.isneginf(m)
    m = m.masked_fill(empty, 0.0)
    e = torch.exp(s - m)
    z = e.sum(-1, keepdim=True).masked_fill(empty, 1.0)
    out = torch.matmul(e / z, vc)
    lse = (m + torch.log(z)).masked_fill(empty, -math.inf).squeeze(-1)  # (B, H, Lq)
    return out, lse


# ATen's CPU flash kernel walks (query tile, key tile) pairs with a small GEMM call each; when
# the keys are few its tiles are tiny and it loses to plain ops: two batched GEMMs and a softmax,
# which Inductor fuses under compile. Forward + backward, compiled, 2 threads, fp32: the demo's
# shapes (32 x 4 heads x 64 queries, head dim 32) 4.6 -> 2.3 ms with 16 keys, 5.4 -> 3.6 ms with 64;
# DiT-S cross-attention (6 heads x 256 queries, dim 64, 16 keys) 21 -> 15 ms; one thread breaks
# even. At 256 keys flash wins (97 vs 159 ms), and its memory stays linear in the keys, so only
# short key sequences take the math path: their scores (saved for backward) hold at most 64
# values per query and head, about as many as q, k and v themselves. Plain tensors only (a
# DTensor stays on SDPA's sharding rule).
CPU_MATH_MAX_KEYS = 64


def _short_keys_math(q, k, v, attn_mask, scale):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if torch.compiler.is_compiling():
        # The scale goes on q, where Inductor fuses it into the QK-norm's kernel: its softmax of
        # scaled scores makes three row reductions (max of s, max of s * scale, a finiteness
        # check) where an unscaled one makes one (compiled demo block, 1 thread: 0.66 -> 0.48 ms),
        # and its attention pattern rewrites the scaled-scores form, compiled alone, into the CPU
        # flash kernel this path exists to avoid. Eager keeps the scores' scale, ATen's softmax
        # being one kernel either way.
        s = torch.matmul(q * scale, k.transpose(-1, -2))
    else:
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
    has_key = None
    if attn_mask is not None:
        # A query row whose keys are all masked gets a zero output and zero gradients, as SDPA
        # gives past CPU_MATH_MAX_KEYS, not the NaN of a softmax over -inf alone: the row attends
        # to every key and its output is multiplied by 0 (zeroing the probabilities instead
        # made Inductor recompute the softmax in backward). Eager checks first (free on CPU), so
        # masks without such rows run as before; compiled code cannot branch on the values.
        is_bool = attn_mask.dtype == torch.bool
        has_key = (attn_mask if is_bool else attn_mask > -math.inf).any(-1, keepdim=True)
        if torch.compiler.is_compiling() or not bool(has_key.all()):
            attn_mask = attn_mask | ~has_key if is_bool else attn_mask.masked_fill(~has_key, 0.0)
        else:
            has_key = None
        s = s.masked_fill(~attn_mask, -math.inf) if is_bool else s + attn_mask
    out = torch.matmul(s.softmax(-1), v)
    return out if has_key is None else out * has_key.to(out.dtype)


def _sdpa(q, k, v, causal, attn_mask, scale):
    h = q.shape[1]
    k, v = _expand_kv(k, h), _expand_kv(v, h)
    lq, lk = q.shape[2], k.shape[2]
    if (lk <= CPU_MATH_MAX_KEYS and not causal and q.dtype in (torch.float32, torch.float64)
            and dispatch_device(q, k, v, attn_mask) == torch.device("cpu")):
        return _short_keys_math(q, k, v, attn_mask, scale)
    if causal and (attn_mask is not None or lq != lk):
        # SDPA's is_causal is top-left aligned and exclusive with attn_mask: build the bias.
        attn_mask = _combined_bias(lq, lk, True, attn_mask, q.device, q.dtype)
        causal = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, scale=scale)


def _lse_dtype(q):
    # fp32 accumulation at minimum; keeps fp64 inputs in fp64.
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _dense(impl, q, k, v, causal, attn_mask, return_lse, scale):
    if impl == "triton":
        from .triton.flash_attention import flash_attention
        out, lse = flash_attention(q, k, v, causal=causal, scale=scale)
        return (out, lse) if return_lse else out
    if impl == "flash_attn":
        fn, _ = _flash_attn_fns()
        out, lse = _call_flash_attn(fn, (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)),
                                    causal, scale, return_lse)
        out = out.transpose(1, 2)
        return (out, lse.float()) if return_lse else out
    if return_lse or impl == "reference":
        out, lse = _math_attention(q, k, v, causal, attn_mask, scale, _lse_dtype(q))
        out = out.to(q.dtype)
        return (out, lse.float()) if return_lse else out
    return _sdpa(q, k, v, causal, attn_mask, scale)


def _varlen(impl, q, k, v, causal, return_lse, scale, cu_q, cu_k, max_q, max_k):
    if impl == "triton":
        from .triton.flash_attention import flash_attention_varlen
        out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale)
        return (out, lse) if return_lse else out
    if impl == "flash_attn":
        _, fn = _flash_attn_fns()
        cu_q, cu_k = cu_q.to(q.device, torch.int32), cu_k.to(q.device, torch.int32)
        if max_q is None:
            max_q = int((cu_q[1:] - cu_q[:-1]).max())
        if max_k is None:
            max_k = int((cu_k[1:] - cu_k[:-1]).max())
        out, lse = _call_flash_attn(fn, (q, k, v, cu_q, cu_k, max_q, max_k), causal, scale, return_lse)
        return (out, lse.float()) if return_lse else out
    # torch / reference: one dense call per sequence (SDPA has no varlen form that returns lse).
    bq, bk = cu_q.tolist(), cu_k.tolist()
    # split, not one slice per sequence: split's backward is one concatenation, while every
    # slice's backward adds into a zero tensor the size of the whole batch (samples x tokens).
    sq, sk = [b - a for a, b in zip(bq, bq[1:])], [b - a for a, b in zip(bk, bk[1:])]
    qs = q[bq[0]:bq[-1]].split(sq)
    ks, vs = k[bk[0]:bk[-1]].split(sk), v[bk[0]:bk[-1]].split(sk)
    outs, lses = [], []
    for i in range(len(bq) - 1):
        qi, ki, vi = (x[i].transpose(0, 1).unsqueeze(0) for x in (qs, ks, vs))  # (1, H, L, D)
        if ki.shape[2] == 0:  # no keys at all: an empty row by definition
            oi = qi.new_zeros(qi.shape)
            li = torch.full(qi.shape[:3], -math.inf, device=q.device)
        else:
            res = _dense(impl, qi, ki, vi, causal, None, return_lse, scale)
            oi, li = res if return_lse else (res, None)
        outs.append(oi[0].transpose(0, 1))
        lses.append(None if li is None else li[0])
    out = torch.cat(outs, 0) if outs else q.new_zeros(q.shape)
    if not return_lse:
        return out
    lse = torch.cat(lses, -1) if lses else torch.empty(q.shape[1], 0, device=q.device)
    return out, lse.float()


# ------------------------------------------------------------------------------------------------
# flash-attn package (optional; never a dependency)
# ------------------------------------------------------------------------------------------------
_FLASH_ATTN: tuple | None | bool = False  # False = not looked up yet


def _flash_attn_fns():
    """(dense fn, varlen fn) from FA3 (flash_attn_interface, Hopper) or FA2, or None."""
    global _FLASH_ATTN
    if _FLASH_ATTN is False:
        _FLASH_ATTN = None
        for mod in ("flash_attn_interface", "flash_attn"):
            try:
                m = __import__(mod)
                _FLASH_ATTN = (m.flash_attn_func, m.flash_attn_varlen_func)
                break
            except (ImportError, AttributeError, OSError, RuntimeError):
                continue
    return _FLASH_ATTN


def _call_flash_attn(fn, args, causal, scale, return_lse):
    # FA2 returns (out, lse, probs) with return_attn_probs; FA3 versions return out or (out, lse).
    res = fn(*args, softmax_scale=scale, causal=causal, return_attn_probs=return_lse)
    if isinstance(res, tuple):
        return res[0], res[1]
    if return_lse:
        raise RuntimeError("this flash-attn build does not return the softmax lse")
    return res, None


# ------------------------------------------------------------------------------------------------
# dispatch
# ------------------------------------------------------------------------------------------------

def _unsupported(name, q, k, v, attn_mask, varlen) -> str | None:
    """Why backend `name` cannot run this call, or None when it can."""
    if name in ("reference", "torch"):
        return None
    if attn_mask is not None:
        return f"attention backend {name!r} does not support attn_mask (use 'torch', 'reference' or 'auto')"
    if dispatch_device(q, k, v) is None:
        return f"attention backend {name!r} needs plain tensors, not {type(q).__name__}"
    if name == "triton":
        if not triton_available():
            return "attention backend 'triton' needs the triton package"
        if q.device.type != "cuda" and not triton_interpreting():
            return (f"attention backend 'triton' needs CUDA tensors (got {q.device}); set TRITON_INTERPRET=1 "
                    "before importing triton to run the kernels on CPU")
        from .triton.flash_attention import supports
        return supports(q, k, v)
    if name == "flash_attn":
        if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
            return "attention backend 'flash_attn' needs CUDA fp16/bf16 tensors"
        if q.shape[-1] > 256 or q.shape[-1] % 8:
            return "attention backend 'flash_attn' needs a head dim <= 256 divisible by 8"
        if _flash_attn_fns() is None:
            return "attention backend 'flash_attn' needs the flash-attn package (not importable)"
        return None
    raise ValueError(f"unknown attention backend {name!r}")


def _auto(q, k, v, attn_mask, return_lse, varlen) -> str:
    dev = dispatch_device(q, k, v)
    row = "cuda" if dev is not None and dev.type == "cuda" and not torch.compiler.is_compiling() else "default"
    need = {(False, False): "plain", (False, True): "lse", (True, False): "varlen", (True, True): "varlen_lse"}
    for name in AUTO_PREFERENCE[row].get(need[varlen, bool(return_lse)], ()):
        if _unsupported(name, q, k, v, attn_mask, varlen) is None:
            return name
    return "reference"


def attention(q, k, v, *, causal: bool = False, attn_mask=None, return_lse: bool = False,
              scale: float | None = None, backend: str | None = None,
              cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
              max_seqlen_q: int | None = None, max_seqlen_k: int | None = None):
    """Scaled dot-product attention. Returns out (B, H, Lq, D), or (out, lse) with lse
    (B, H, Lq) fp32 when return_lse=True (needed to merge blockwise/ring partial results).

    With cu_seqlens_q/k: packed varlen layout (see the module docstring), out (total_q, H, D) and
    lse (H, total_q); max_seqlen_q/k spare the triton/flash_attn paths a device sync.
    `backend` given here is a per-call contract: a backend that cannot serve the arguments raises
    ValueError. A backend chosen globally (use_backend, MMP_KERNEL_BACKEND) is a preference: a
    call it cannot serve (e.g. attn_mask with "triton") is routed as "auto" would route it.
    """
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("varlen attention needs both cu_seqlens_q and cu_seqlens_k")
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            raise ValueError("varlen attention expects 3-D q, k, v shaped (total_tokens, H, D)")
        if attn_mask is not None:
            raise ValueError("attn_mask is not supported with cu_seqlens (sequences are the mask)")
        if cu_seqlens_q.numel() != cu_seqlens_k.numel() or cu_seqlens_q.numel() < 1:
            raise ValueError("cu_seqlens_q and cu_seqlens_k must both have B + 1 entries")
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"query heads {q.shape[1]} not a multiple of kv heads {k.shape[1]}")
    elif q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("attention expects 4-D q, k, v shaped (B, H, L, D)")
    name = requested_backend(backend)
    if name == "auto":
        name = _auto(q, k, v, attn_mask, return_lse, varlen)
    else:
        reason = _unsupported(name, q, k, v, attn_mask, varlen)
        if reason is not None:
            if backend is not None or attn_mask is None:
                raise ValueError(reason)
            name = _auto(q, k, v, attn_mask, return_lse, varlen)
    if varlen:
        return _varlen(name, q, k, v, causal, return_lse, scale, cu_seqlens_q, cu_seqlens_k,
                       max_seqlen_q, max_seqlen_k)
    return _dense(name, q, k, v, causal, attn_mask, return_lse, scale)


def attention_reference(q, k, v, *, causal: bool = False, attn_mask=None, scale: float | None = None,
                        dtype: torch.dtype = torch.float64):
    """Ground truth for tests: math attention in `dtype` (float64 by default); returns (out, lse)."""
    return _math_attention(q, k, v, causal, attn_mask, scale, dtype)
