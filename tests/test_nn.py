"""common.nn blocks: shapes, identity at init, masking, gradient flow."""
import torch
from torch import nn

from common.kernels import rope_frequencies
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


def test_shapes():
    torch.manual_seed(0)
    x, ctx = torch.randn(2, 16, D), torch.randn(2, 5, 24)
    assert SelfAttention(D, H)(x, rope=_rope(16)).shape == x.shape
    assert CrossAttention(D, H, 24)(x, ctx).shape == x.shape
    assert MLP(D, 64)(x).shape == x.shape and SwiGLU(D, 48)(x).shape == x.shape
    blk = DiTBlock(D, H, context_dim=24)
    assert blk(x, torch.randn(2, 6 * D), ctx, None, _rope(16)).shape == x.shape
    assert FinalLayer(D, 12)(x, torch.randn(2, D)).shape == (2, 16, 12)
    assert TimestepEmbedder(D)(torch.rand(2)).shape == (2, D)


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


def test_dit_block_identity_at_init():
    torch.manual_seed(0)
    blk = DiTBlock(D, H, context_dim=24)
    x = torch.randn(2, 16, D)
    out = blk(x, torch.zeros(2, 6 * D), torch.randn(2, 5, 24), None, _rope(16))
    torch.testing.assert_close(out, x)
    fin = FinalLayer(D, 12)
    assert torch.all(fin(x, torch.randn(2, D)) == 0)


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
