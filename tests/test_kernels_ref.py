"""common.kernels reference numerics. fp32 paths vs float64 math: atol 1e-5, rtol 1e-4."""
import math

import pytest
import torch

from common.kernels import (apply_rope, attention, attention_reference, gelu_tanh, layer_norm, modulate, mul_add,
                            norm_modulate, rms_norm, rms_norm_rope, rope_frequencies, use_backend)

ATOL, RTOL = 1e-5, 1e-4


@pytest.fixture(autouse=True)
def _fixed_inputs():
    """Inputs drawn without an explicit generator are the same every run (a failure reproduces)."""
    torch.manual_seed(0)


def _no_cpp_compiler() -> bool:
    from common.parallel.compile import _cpp_compiler
    return _cpp_compiler() is None


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


@pytest.mark.parametrize("lk", [16, 64, 65])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_cpu_short_keys_take_math_and_match_fp64_with_grads(lk, mask_kind):
    # At most 64 keys (CPU_MATH_MAX_KEYS; CPU, fp32) the plain path runs three ops instead of ATen's
    # flash kernel (faster at these shapes); either side of the threshold matches float64 math,
    # value and gradients, under a key padding mask.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.__name__)
            return func(*args, **(kwargs or {}))

    q, k, v = (t.requires_grad_() for t in _qkv(b=3, lq=20, lk=lk, d=32))
    valid = torch.rand(3, lk) > 0.4
    valid[:, 0] = True
    mask = valid[:, None, None, :]
    if mask_kind == "float":
        mask = torch.zeros(mask.shape).masked_fill(~mask, -math.inf) + torch.rand(3, 1, 1, lk)
    g = torch.randn(3, 4, 20, 32)
    with Ops() as ops:
        out = attention(q, k, v, attn_mask=mask)
        grads = torch.autograd.grad(out, (q, k, v), g)
    assert any("flash" in n for n in ops.names) == (lk > 64), ops.names  # CPU_MATH_MAX_KEYS
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(qd, kd, vd, attn_mask=mask.double() if mask_kind == "float" else mask)
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), g.double())
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=RTOL)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.skipif(
    _no_cpp_compiler(), reason="inductor's CPU backend needs a C++ compiler"))])
@pytest.mark.parametrize("lk", [16, 65])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_fully_masked_query_rows_give_zeros_either_side_of_the_math_threshold(mask_kind, lk, compiled):
    # A query row with every key masked: zero output and zero, finite gradients, as the float64
    # reference and SDPA (past CPU_MATH_MAX_KEYS) give; the short-keys math path gave NaN there.
    # Per-query masks (B, 1, Lq, Lk), rows 2 and 5 empty in the first sample.
    q, k, v = (t.requires_grad_() for t in _qkv(b=2, lq=8, lk=lk, d=16))
    valid = torch.rand(2, 1, 8, lk) > 0.5
    valid[..., 0] = True
    valid[0, :, [2, 5]] = False
    mask = valid if mask_kind == "bool" else torch.zeros(valid.shape).masked_fill(~valid, -math.inf)
    fn = torch.compile(attention, backend="inductor", dynamic=False) if compiled else attention
    out = fn(q, k, v, attn_mask=mask)
    g = torch.randn(out.shape)
    grads = torch.autograd.grad(out, (q, k, v), g)
    assert torch.equal(out[0, :, [2, 5]], torch.zeros_like(out[0, :, [2, 5]]))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(qd, kd, vd, attn_mask=valid)
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), g.double())
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=RTOL)
    for got, want in zip(grads, ref_grads):
        assert got.isfinite().all()
        torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=RTOL)


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


@pytest.mark.parametrize("shapes", [((3, 1, 8), (3, 5, 8), (3, 1, 8)),   # adaLN modulate: shift, x, 1 + scale
                                    ((3, 5, 8), (3, 1, 8), (3, 5, 8)),   # gated residual: x, gate, branch
                                    ((8,), (5, 8), (1, 8))])
def test_mul_add_matches_addcmul_and_fp64_gradients(shapes):
    # Forward bit for bit torch.addcmul; each input's gradient (summed back to its broadcast shape)
    # equals float64 autograd; an input that needs no gradient gets none.
    g = torch.Generator().manual_seed(5)
    base, a, b = (torch.randn(s, generator=g).requires_grad_() for s in shapes)
    y = mul_add(base, a, b)
    assert type(y.grad_fn).__name__ == "_MulAddBackward" and torch.equal(y, torch.addcmul(base, a, b))
    upstream = torch.randn(y.shape, generator=g)
    y.backward(upstream)
    ref_inputs = [t.detach().double().requires_grad_() for t in (base, a, b)]
    (ref_inputs[0] + ref_inputs[1] * ref_inputs[2]).backward(upstream.double())
    for t, r in zip((base, a, b), ref_inputs):
        assert t.grad.shape == t.shape
        torch.testing.assert_close(t.grad.double(), r.grad, atol=ATOL, rtol=RTOL)
    frozen = a.detach()
    mul_add(base, frozen, b).sum().backward()
    assert frozen.grad is None


def test_mul_add_is_addcmul_off_the_cpu():
    """The hand-written node saves a memory pass on CPU; elsewhere (here the meta device, as a
    stand-in for a GPU) it is ATen's addcmul, whose C++ backward costs less host time."""
    base, a, b = (torch.randn((2, 3, 4), device="meta", requires_grad=True) for _ in range(3))
    assert type(mul_add(base, a, b).grad_fn).__name__ == "AddcmulBackward0"


def _gelu_tanh_fp64(x):
    """GELU's tanh approximation written out in float64 (no project code)."""
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _gelu_inputs():
    # Both tails (sigmoid saturates to 0 and 1, x^3 overflows fp32 past ~7e12) and the centre.
    x = torch.cat([torch.linspace(-12, 12, 4001), torch.tensor([-1e4, -60.0, 60.0, 1e4, 1e13, -1e13])])
    return x, torch.randn(x.shape)


def test_gelu_tanh_sigmoid_form_matches_fp64():
    # The form compiled CPU code uses, x * sigmoid(2c (x + 0.044715 x^3)), against the tanh formula
    # in float64: value and gradient, absolute error within fp32 rounding of the result.
    from common.kernels.gelu import gelu_tanh_sigmoid_form
    x, upstream = _gelu_inputs()
    xs = x.clone().requires_grad_()
    y = gelu_tanh_sigmoid_form(xs)
    y.backward(upstream)
    xd = x.double().requires_grad_()
    ref = _gelu_tanh_fp64(xd)
    ref.backward(upstream.double())
    scale = x.abs().clamp(min=1).double()  # the result is ~x for large x: compare relative there
    assert ((y.detach().double() - ref.detach()) / scale).abs().max() < 1e-6
    assert ((xs.grad.double() - xd.grad).abs()).max() < 1e-5
    torch.testing.assert_close(gelu_tanh(x), torch.nn.functional.gelu(x, approximate="tanh"), rtol=0, atol=0)


@pytest.mark.skipif(_no_cpp_compiler(), reason="inductor's CPU backend needs a C++ compiler")
def test_gelu_tanh_compiled_on_cpu_writes_no_tanh():
    # Under inductor on CPU, gelu_tanh compiles to the exp-based sigmoid form (tanh is several times
    # slower there: bench/cpu_gelu.py), and its value and gradient match eager's.
    from torch._inductor.utils import run_and_get_code
    x, upstream = _gelu_inputs()  # 4007 elements: a vectorised main loop and a scalar tail

    def f(t):
        y = gelu_tanh(t)
        y.backward(upstream)
        return y.detach(), t.grad

    compiled = torch.compile(lambda t: gelu_tanh(t), backend="inductor", dynamic=False)
    xc = x.clone().requires_grad_()
    (yc,), code = run_and_get_code(lambda: (compiled(xc),))
    yc.backward(upstream)
    assert "tanh" not in "\n".join(code) and "exp" in "\n".join(code)
    y_eager, g_eager = f(x.clone().requires_grad_())
    scale = x.abs().clamp(min=1)
    assert ((yc.detach() - y_eager) / scale).abs().max() < 2e-6
    assert (xc.grad - g_eager).abs().max() < 2e-5


def _norm_rope_fp64(x, w, cos, sin, eps=1e-6):
    """QK-norm then rotate-half RoPE, written out in float64 (no project code)."""
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    if cos is None:
        return y
    y1, y2 = y.chunk(2, dim=-1)
    return y * cos + torch.cat([-y2, y1], dim=-1) * sin


@pytest.mark.parametrize("weight", ["trained", "frozen", "none"])
@pytest.mark.parametrize("with_rope", [True, False])
def test_fused_norm_rope_matches_fp64_forward_and_backward(with_rope, weight):
    # The eager torch path is one autograd node with a hand-written backward: its output and the
    # gradients of x and the norm weight must equal float64 autograd through the plain formula,
    # on a head view (B, L, H, D) -> (B, H, L, D) as attention passes it, tables (L, D) broadcast.
    # Each weight case takes its own buffer path in the backward (in place on ours, never on g).
    g = torch.Generator().manual_seed(3)
    b, h, n, d = 2, 3, 6, 8
    x = torch.randn(b, n, h, d, generator=g).mul(3).transpose(1, 2).requires_grad_()
    w = torch.randn(d, generator=g).requires_grad_(weight == "trained")
    cos, sin = rope_frequencies(torch.stack(torch.meshgrid(torch.arange(2), torch.arange(3), indexing="ij"),
                                            -1).reshape(-1, 2), (d // 2, d // 2))
    rope = (cos, sin) if with_rope else None
    y = rms_norm_rope(x, None if weight == "none" else w, 1e-6, rope)
    assert type(y.grad_fn).__name__ == "_RMSNormRopeBackward"  # the fused node, not the composite
    upstream = torch.randn(y.shape, generator=g)
    upstream_before = upstream.clone()
    y.backward(upstream)
    assert torch.equal(upstream, upstream_before)  # the incoming gradient is not written to
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = _norm_rope_fp64(xd, wd if weight != "none" else 1.0, cos.double() if with_rope else None,
                          sin.double() if with_rope else None)
    ref.backward(upstream.double())
    torch.testing.assert_close(y.double(), ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(x.grad.double(), xd.grad, atol=ATOL, rtol=RTOL)
    if weight == "trained":
        torch.testing.assert_close(w.grad.double(), wd.grad, atol=ATOL, rtol=RTOL)
    else:
        assert w.grad is None
    assert x.grad.stride() == x.stride()  # the gradient keeps the head view's layout


def test_fused_norm_rope_half_precision_and_fallbacks():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(2, 2, 5, 8, generator=g), torch.randn(8, generator=g)
    cos, sin = rope_frequencies(torch.arange(5), (8,))
    ref = _norm_rope_fp64(x.double(), w.double(), cos.double(), sin.double())
    xb = x.bfloat16().requires_grad_()
    y = rms_norm_rope(xb, w, 1e-6, (cos, sin))
    y.sum().backward()
    assert y.dtype == torch.bfloat16 and xb.grad.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), ref, atol=0.05, rtol=0.02)  # math in fp32, one bf16 rounding
    # float64 and the reference backend take the composite (the exact reference path)
    xd = x.double().requires_grad_()
    assert type(rms_norm_rope(xd, w.double(), 1e-6, (cos.double(), sin.double())).grad_fn).__name__ != \
        "_RMSNormRopeBackward"
    with use_backend("reference"):
        yr = rms_norm_rope(x.requires_grad_(), w, 1e-6, (cos, sin))
    assert type(yr.grad_fn).__name__ != "_RMSNormRopeBackward"
    torch.testing.assert_close(yr.double(), ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.skipif(
    _no_cpp_compiler(), reason="inductor's CPU backend needs a C++ compiler"))])
def test_composite_norm_rope_and_short_keys_attention_match_fp64(compiled):
    # What torch.compile traces (and eager takes for DTensors and the reference backend): the
    # composite QK-norm + RoPE (rotated per half under compile, by rotate-half in eager) and, on
    # CPU with few keys, attention with the softmax scale on q under compile and on the scores in
    # eager. Value and the gradients of x, the norm weights and v against float64 autograd
    # through the plain formulas, on a head view (B, L, H, D) -> (B, H, L, D); tables whose
    # halves differ, so no half is read for the other.
    from torch._inductor.utils import run_and_get_code
    g = torch.Generator().manual_seed(5)
    b, h, n, d = 2, 3, 6, 8
    xq, xk, v = (torch.randn(b, n, h, d, generator=g).mul(2).transpose(1, 2) for _ in range(3))
    wq, wk = (torch.randn(d, generator=g) for _ in range(2))
    cos, sin = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
    upstream = torch.randn(b, h, n, d, generator=g)

    def block(xq, xk, v, wq, wk, cos, sin):
        q = apply_rope(rms_norm(xq, wq, 1e-6, backend="reference"), cos, sin)
        k = apply_rope(rms_norm(xk, wk, 1e-6, backend="reference"), cos, sin)
        return attention(q, k, v)

    leaves = [t.clone().requires_grad_() for t in (xq, xk, v, wq, wk)]
    fn = torch.compile(block, backend="inductor", dynamic=False) if compiled else block
    out, code = run_and_get_code(fn, *leaves, cos, sin) if compiled else (fn(*leaves, cos, sin), [])
    out.backward(upstream)
    if compiled:
        # The short-keys math reaches Inductor's code as bmm + softmax with one row max: no
        # finiteness check of scaled scores (an abs per score), no rewrite into the CPU flash
        # kernel (which Inductor's attention pattern made of the scaled-scores form when nothing
        # preceded it).
        assert "flash_attention" not in code[0] and "bmm" in code[0] and "abs(" not in code[0]

    ref_leaves = [t.double().requires_grad_() for t in (xq, xk, v, wq, wk)]
    rq, rk, rv, rwq, rwk = ref_leaves
    q, k = (_norm_rope_fp64(x, w, cos.double(), sin.double()) for x, w in ((rq, rwq), (rk, rwk)))
    p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), -1)
    ref = p @ rv
    ref.backward(upstream.double())
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=RTOL)
    for leaf, ref_leaf in zip(leaves, ref_leaves):
        torch.testing.assert_close(leaf.grad.double(), ref_leaf.grad, atol=ATOL, rtol=RTOL)


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
