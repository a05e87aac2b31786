"""common.kernels reference numerics. fp32 paths vs float64 math: atol 1e-5, rtol 1e-4."""
import math

import pytest
import torch

from common.kernels import (apply_rope, attention, attention_reference, layer_norm, modulate,
                            norm_modulate, rms_norm, rope_frequencies, use_backend)

ATOL, RTOL = 1e-5, 1e-4


@pytest.fixture(autouse=True)
def _fixed_inputs():
    """Inputs drawn without an explicit generator are the same every run (a failure reproduces)."""
    torch.manual_seed(0)


def _qkv(b=2, h=4, hkv=4, lq=9, lk=9, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, lq, d, generator=g), torch.randn(b, hkv, lk, d, generator=g),
            torch.randn(b, hkv, lk, d, generator=g))


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk", [(9, 9), (5, 11)])
def test_attention_matches_fp64(ratio, causal, lq, lk):
    q, k, v = _qkv(h=4, hkv=4 // ratio, lq=lq, lk=lk)
    ref, ref_lse = attention_reference(q.double(), k.double(), v.double(), causal=causal)
    out = attention(q, k, v, causal=causal)
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=RTOL)
    out2, lse = attention(q, k, v, causal=causal, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    torch.testing.assert_close(out2.double(), ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(lse.double(), ref_lse, atol=ATOL, rtol=RTOL)
    with use_backend("reference"):
        torch.testing.assert_close(attention(q, k, v, causal=causal).double(), ref, atol=ATOL, rtol=RTOL)


def test_gqa_equals_repeated_kv():
    q, k, v = _qkv(h=8, hkv=2)
    full = attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1))
    torch.testing.assert_close(attention(q, k, v), full, atol=ATOL, rtol=RTOL)


def test_key_padding_mask_and_lse():
    q, k, v = _qkv(lk=7)
    valid = torch.tensor([[1, 1, 1, 0, 0, 0, 0], [1] * 7], dtype=torch.bool)
    mask = valid[:, None, None, :]
    out, lse = attention(q, k, v, attn_mask=mask, return_lse=True)
    torch.testing.assert_close(attention(q, k, v, attn_mask=mask), out, atol=ATOL, rtol=RTOL)
    # sample 0 equals attention over its first 3 keys only
    torch.testing.assert_close(out[:1], attention(q[:1], k[:1, :, :3], v[:1, :, :3]), atol=ATOL, rtol=RTOL)
    # lse is the logsumexp of the scaled, masked scores
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~mask, -math.inf)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), atol=ATOL, rtol=RTOL)


def test_lse_merges_blocks():
    """Two key blocks merged with their LSEs equal attention over all keys (ring attention)."""
    q, k, v = _qkv(lk=12)
    o1, l1 = attention(q, k[:, :, :5], v[:, :, :5], return_lse=True)
    o2, l2 = attention(q, k[:, :, 5:], v[:, :, 5:], return_lse=True)
    lse = torch.logaddexp(l1, l2)
    merged = o1 * (l1 - lse).exp()[..., None] + o2 * (l2 - lse).exp()[..., None]
    torch.testing.assert_close(merged, attention(q, k, v), atol=ATOL, rtol=RTOL)


def test_fully_masked_rows_lse_path():
    q, k, v = _qkv(lk=4)
    mask = torch.zeros(2, 1, 1, 4, dtype=torch.bool)
    out, lse = attention(q, k, v, attn_mask=mask, return_lse=True)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


def test_custom_scale_and_bad_backend():
    q, k, v = _qkv()
    ref, _ = attention_reference(q, k, v, scale=0.3)
    torch.testing.assert_close(attention(q, k, v, scale=0.3).double(), ref, atol=ATOL, rtol=RTOL)
    with pytest.raises(ValueError):
        attention(q, k, v, backend="cuda-magic")


def test_norms_match_fp64():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(3, 5, 32, generator=g), torch.randn(32, generator=g), torch.randn(32, generator=g)
    xd = x.double()
    ref_rms = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(rms_norm(x, w, 1e-6).double(), ref_rms, atol=ATOL, rtol=RTOL)
    mu, var = xd.mean(-1, keepdim=True), xd.var(-1, unbiased=False, keepdim=True)
    ref_ln = (xd - mu) / torch.sqrt(var + 1e-6) * w.double() + b.double()
    for backend in ("torch", "reference"):
        torch.testing.assert_close(layer_norm(x, w, b, 1e-6, backend=backend).double(), ref_ln,
                                   atol=ATOL, rtol=RTOL)
    shift, scale = torch.randn(3, 32, generator=g), torch.randn(3, 32, generator=g)
    ref_mod = xd * (1 + scale.double()[:, None]) + shift.double()[:, None]
    torch.testing.assert_close(modulate(x, shift, scale).double(), ref_mod, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(modulate(x, shift[:, None], scale[:, None]), modulate(x, shift, scale))
    ref_nm = (xd - mu) / torch.sqrt(var + 1e-6) * (1 + scale.double()[:, None]) + shift.double()[:, None]
    torch.testing.assert_close(norm_modulate(x, shift, scale, 1e-6).double(), ref_nm, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dims", [(16,), (8, 8), (4, 6, 6)])
def test_rope_preserves_norm(dims):
    L = 10
    pos = torch.randint(0, 50, (L, len(dims)))
    cos, sin = rope_frequencies(pos, dims)
    assert cos.shape == (L, sum(dims)) and cos.dtype == torch.float32
    x = torch.randn(2, 3, L, sum(dims))
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), atol=ATOL, rtol=RTOL)
    # position 0 on every axis is the identity
    c0, s0 = rope_frequencies(torch.zeros(1, len(dims)), dims)
    torch.testing.assert_close(apply_rope(x[:, :, :1], c0, s0), x[:, :, :1])


def test_rope_relative_position_1d():
    d, L = 16, 12
    cos, sin = rope_frequencies(torch.arange(L).double(), (d,))
    q = torch.randn(d).expand(1, 1, L, d).contiguous()
    k = torch.randn(d).expand(1, 1, L, d).contiguous()
    s = (apply_rope(q, cos, sin) @ apply_rope(k, cos, sin).transpose(-1, -2))[0, 0]
    # same vector at every position: score depends only on i - j -> constant along diagonals
    for off in range(-L + 1, L):
        diag = torch.diagonal(s, off)
        torch.testing.assert_close(diag, diag[:1].expand_as(diag), atol=1e-4, rtol=1e-4)


def test_rope_2d_axes_independent():
    """Moving along one axis only rotates that axis's channels (2-D RoPE factorises)."""
    dims = (8, 8)
    x = torch.randn(1, 1, 1, 16)
    c, s = rope_frequencies(torch.tensor([[3, 0]]), dims)
    y = apply_rope(x, c, s)
    # channels of axis 1 (indices 4..7 and 12..15 in rotate-half layout) unchanged
    idx = torch.tensor([4, 5, 6, 7, 12, 13, 14, 15])
    torch.testing.assert_close(y[..., idx], x[..., idx])
