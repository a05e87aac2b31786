"""Attention dispatch: the single entry point models use for softmax attention.

Shapes: q (B, H, Lq, D); k, v (B, Hkv, Lk, D) with H a multiple of Hkv (GQA: query head h reads
kv head h // (H // Hkv)). attn_mask: bool (True = may attend) or additive float, broadcastable
to (B, H, Lq, Lk). causal=True masks key j for query i when j > i + (Lk - Lq): bottom-right
aligned (flash-attn convention), which equals SDPA's is_causal when Lq == Lk and is what a query
block at the end of a longer key sequence (decoding, ring blocks) needs.

Fully masked query rows: the LSE/reference paths return out = 0 and lse = -inf (so ring
attention merges them as empty blocks); the SDPA path leaves them undefined (NaN), so callers
such as CrossAttention guarantee at least one valid key.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .backend import resolve_backend


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
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Lq); -inf on fully masked rows
    # exp(s - lse) is the softmax; guard -inf - -inf = nan on fully masked rows.
    p = torch.exp(s - lse.unsqueeze(-1).masked_fill(torch.isinf(lse).unsqueeze(-1), 0.0))
    out = torch.matmul(p, vc)
    return out, lse


def attention(q, k, v, *, causal: bool = False, attn_mask=None, return_lse: bool = False,
              scale: float | None = None, backend: str | None = None):
    """Scaled dot-product attention. Returns out (B, H, Lq, D), or (out, lse) with lse
    (B, H, Lq) fp32 when return_lse=True (needed to merge blockwise/ring partial results)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("attention expects 4-D q, k, v shaped (B, H, L, D)")
    impl = resolve_backend(backend)
    if return_lse or impl == "reference":
        # fp32 accumulation at minimum; keeps fp64 inputs in fp64.
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        out, lse = _math_attention(q, k, v, causal, attn_mask, scale, cdt)
        out = out.to(q.dtype)
        return (out, lse.float()) if return_lse else out
    h = q.shape[1]
    k, v = _expand_kv(k, h), _expand_kv(v, h)
    lq, lk = q.shape[2], k.shape[2]
    if causal and (attn_mask is not None or lq != lk):
        # SDPA's is_causal is top-left aligned and exclusive with attn_mask: build the bias.
        attn_mask = _combined_bias(lq, lk, True, attn_mask, q.device, q.dtype)
        causal = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, scale=scale)


def attention_reference(q, k, v, *, causal: bool = False, attn_mask=None, scale: float | None = None,
                        dtype: torch.dtype = torch.float64):
    """Ground truth for tests: math attention in `dtype` (float64 by default); returns (out, lse)."""
    return _math_attention(q, k, v, causal, attn_mask, scale, dtype)
