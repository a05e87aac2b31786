"""common.nn blocks: outputs against written-out math, identity at init, masking, gradient flow."""
import math

import pytest
import torch
from torch import nn

from common.kernels import apply_rope, rope_frequencies
from common.nn import attention as attention_module
from common.nn import (MLP, CrossAttention, DiTBlock, FinalLayer, PatchEmbed2d, SelfAttention, SwiGLU,
                       TimestepEmbedder, patchify, unpatchify)

D, H = 32, 4


def _randomize(module: nn.Module, seed: int = 0):
    """Replace zero-inits with small random values so every path carries signal."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return module


def _rope(n, hd=D // H):
    side = int(n ** 0.5)
    r, c = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    return rope_frequencies(torch.stack([r.flatten(), c.flatten()], -1), (hd // 2, hd // 2))


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _modulate(x, shift, scale, eps=1e-6):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], eps=eps) * (1 + scale[:, None]) + shift[:, None]


def _gelu_tanh(z):
    return 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))


def _ref_attention(m, x, kv, rope=None, mask=None):
    """Written-out multi-head attention with QK RMS-norm: what SelfAttention/CrossAttention compute."""
    b, n, _ = x.shape
    def heads(t):
        return t.view(b, t.shape[1], m.heads, m.head_dim).transpose(1, 2)
    q, k, v = heads(m.to_q(x)), heads(m.to_k(kv)), heads(m.to_v(kv))
    q, k = _rms(q, m.q_norm.weight), _rms(k, m.k_norm.weight)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    s = q @ k.transpose(-1, -2) / math.sqrt(m.head_dim)
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    return m.proj((torch.softmax(s, -1) @ v).transpose(1, 2).reshape(b, n, -1))


def test_blocks_match_written_out_math():
    """Every block (randomised, float64) against its formula written out here, not just its shape."""
    torch.manual_seed(0)
    x, ctx = torch.randn(2, 16, D, dtype=torch.float64), torch.randn(2, 5, 24, dtype=torch.float64)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    rope = tuple(t.double() for t in _rope(16))
    close = dict(atol=1e-10, rtol=1e-10)

    attn = _randomize(SelfAttention(D, H)).double()
    torch.testing.assert_close(attn(x, rope=rope), _ref_attention(attn, x, x, rope), **close)
    cross = _randomize(CrossAttention(D, H, 24)).double()
    torch.testing.assert_close(cross(x, ctx, mask), _ref_attention(cross, x, ctx, mask=mask), **close)
    mlp = _randomize(MLP(D, 64)).double()
    torch.testing.assert_close(mlp(x), mlp.fc2(_gelu_tanh(mlp.fc1(x))), **close)
    glu = _randomize(SwiGLU(D, 48)).double()
    a, g = glu.w1(x), glu.w3(x)
    torch.testing.assert_close(glu(x), glu.w2(a * torch.sigmoid(a) * g), **close)

    blk = _randomize(DiTBlock(D, H, context_dim=24)).double()
    t0 = torch.randn(2, 6 * D, dtype=torch.float64)
    sm, cm, gm, sf, cf, gf = (blk.scale_shift_table[None] + t0.view(2, 6, D)).unbind(1)
    ref = x + gm[:, None] * _ref_attention(blk.attn, _modulate(x, sm, cm), _modulate(x, sm, cm), rope)
    ln = torch.nn.functional.layer_norm(ref, (D,), blk.norm_cross.weight, blk.norm_cross.bias, eps=1e-6)
    ref = ref + _ref_attention(blk.cross_attn, ln, ctx, mask=mask)
    ref = ref + gf[:, None] * blk.mlp.fc2(_gelu_tanh(blk.mlp.fc1(_modulate(ref, sf, cf))))
    torch.testing.assert_close(blk(x, t0, ctx, mask, rope), ref, **close)

    fin = _randomize(FinalLayer(D, 12)).double()
    temb = torch.randn(2, D, dtype=torch.float64)
    shift, scale = (fin.scale_shift_table[None] + temb[:, None]).unbind(1)
    torch.testing.assert_close(fin(x, temb), fin.linear(_modulate(x, shift, scale)), **close)

    emb = _randomize(TimestepEmbedder(D)).float()
    t = torch.tensor([0.0, 0.25, 1.0])
    freqs = torch.exp(-math.log(10000.0) * torch.arange(128) / 128)
    arg = 1000.0 * t[:, None] * freqs
    sincos = torch.cat([torch.cos(arg), torch.sin(arg)], -1)
    torch.testing.assert_close(emb(t), emb.mlp[2](torch.nn.functional.silu(emb.mlp[0](sincos))), atol=1e-5, rtol=1e-5)


def test_patch_roundtrip_and_embed_modes_agree():
    x = torch.randn(2, 3, 8, 12)
    p = patchify(x, 2)
    assert p.shape == (2, 24, 12)
    torch.testing.assert_close(unpatchify(p, 4, 6, 2, 3), x)
    conv, lin = PatchEmbed2d(3, D, 2, "conv"), PatchEmbed2d(3, D, 2, "linear")
    with torch.no_grad():  # conv weight (D, C, p, p) -> linear over (p, p, C) patch layout
        lin.proj.weight.copy_(conv.proj.weight.permute(0, 2, 3, 1).reshape(D, -1))
        lin.proj.bias.copy_(conv.proj.bias)
    torch.testing.assert_close(conv(x), lin(x), atol=1e-5, rtol=1e-5)
    # token-major memory: a transposed conv output would make every later op copy (see embed.py)
    assert conv(x).is_contiguous() and lin(x).is_contiguous()


def test_dit_block_identity_at_init():
    torch.manual_seed(0)
    blk = DiTBlock(D, H, context_dim=24)
    x = torch.randn(2, 16, D)
    out = blk(x, torch.zeros(2, 6 * D), torch.randn(2, 5, 24), None, _rope(16))
    torch.testing.assert_close(out, x)
    fin = FinalLayer(D, 12)
    assert torch.all(fin(x, torch.randn(2, D)) == 0)


@pytest.mark.parametrize("multiple,length,keys_seen", [(1, 7, 4), (16, 7, 16), (16, 40, 16), (4, 8, 4)])
def test_cross_attention_fits_key_padding_with_exact_gradients(monkeypatch, multiple, length, keys_seen):
    # Key columns no sample uses are dropped before the K/V projections (eager CPU) and the count
    # rounded up to CPU_KEY_MULTIPLE (masked zero keys added past the context's end); the output
    # and every gradient still equal the written-out attention over the full padded context.
    monkeypatch.setattr(attention_module, "CPU_KEY_MULTIPLE", multiple)
    torch.manual_seed(0)
    ca = _randomize(CrossAttention(D, H, 24)).double()
    x = torch.randn(2, 6, D, dtype=torch.float64, requires_grad=True)
    ctx = torch.randn(2, length, 24, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, length, dtype=torch.bool)
    mask[0, :2], mask[1, :4] = True, True
    seen = []
    hook = ca.to_k.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    out = ca(x, ctx, mask)
    hook.remove()
    assert seen == [keys_seen]  # the longest caption's length rounded up, not the padded length
    upstream = torch.randn(out.shape, dtype=torch.float64)
    grads = torch.autograd.grad(out, [x, ctx, *ca.parameters()], upstream)
    ref = _ref_attention(ca, x, ctx, mask=mask)
    ref_grads = torch.autograd.grad(ref, [x, ctx, *ca.parameters()], upstream)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    assert grads[1].shape == ctx.shape
    assert torch.all(grads[1][:, 4:] == 0)  # the padding columns' gradient is zero, as it must be


def test_cross_attention_ignores_padding():
    torch.manual_seed(0)
    ca = _randomize(CrossAttention(D, H, 24))
    x, ctx = torch.randn(2, 6, D), torch.randn(2, 5, 24)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    out = ca(x, ctx, mask)
    ctx2 = ctx.clone()
    ctx2[~mask] = 100 * torch.randn(int((~mask).sum()), 24)
    torch.testing.assert_close(ca(x, ctx2, mask), out)
    # dropping the padded tokens entirely gives the same result too
    torch.testing.assert_close(ca(x[:1], ctx[:1, :2]), out[:1], atol=1e-5, rtol=1e-5)
    # a sample with no valid token yields a finite (zero-attention) output
    empty = ca(x, ctx, torch.zeros(2, 5, dtype=torch.bool))
    assert torch.isfinite(empty).all()
    # ... exactly the output projection's bias, also next to a sample that has tokens (the
    # zeroing is skipped only when every sample has one)
    mixed = ca(x, ctx, torch.tensor([[0, 0, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool))
    torch.testing.assert_close(mixed[0], ca.proj.bias.expand(6, D), rtol=0, atol=0)
    torch.testing.assert_close(mixed[1], out[1])


def test_self_attention_rope_changes_output_and_qk_norm_bounds_logits():
    torch.manual_seed(0)
    sa = SelfAttention(D, H)
    x = torch.randn(1, 16, D)
    assert not torch.allclose(sa(x, rope=_rope(16)), sa(x))
    # QK-norm: scaling the input by 100 leaves q, k directions (and attention weights) unchanged
    for lin in (sa.to_q, sa.to_k, sa.to_v):
        lin.bias.data.zero_()
    sa.proj.bias.data.zero_()
    torch.testing.assert_close(sa(100 * x), 100 * sa(x), atol=1e-3, rtol=1e-4)


def test_dit_block_gradients_flow():
    torch.manual_seed(0)
    blk = _randomize(DiTBlock(D, H, context_dim=24))
    x = torch.randn(2, 16, D, requires_grad=True)
    t0 = torch.randn(2, 6 * D, requires_grad=True)
    ctx = torch.randn(2, 5, 24, requires_grad=True)
    blk(x, t0, ctx, torch.ones(2, 5, dtype=torch.bool), _rope(16)).square().mean().backward()
    for name, p in list(blk.named_parameters()) + [("x", x), ("t0", t0), ("ctx", ctx)]:
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_zero_init_block_still_learns():
    """Identity at init must not be a dead end: gates receive gradient on the first step."""
    torch.manual_seed(0)
    blk = DiTBlock(D, H, context_dim=24)
    blk(torch.randn(2, 16, D), torch.zeros(2, 6 * D), torch.randn(2, 5, 24)).sin().sum().backward()
    g = blk.scale_shift_table.grad
    assert g[2].abs().sum() > 0 and g[5].abs().sum() > 0  # gate_msa, gate_mlp
    assert blk.cross_attn.proj.weight.grad.abs().sum() > 0
