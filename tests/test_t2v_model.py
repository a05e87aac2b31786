"""text2video architecture: shapes (video and image), 3-D patches and RoPE, factorized attention,
init, gradients, FLOP estimate."""
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from common.kernels import use_backend
from common.nn import SelfAttention, VideoPatchEmbed, grid_positions, patchify, patchify3d, unpatchify3d
from pipelines.text2image.model import DiT, dit_config
from pipelines.text2video.model import (FactorizedAttention, VideoDiT, default_rope_axes, video_dit_config,
                                        video_dit_flops)

# 4 x 16 x 16 pixels, patches 2 x 4 x 4 -> 2 x 4 x 4 = 32 tokens; head dim 16 -> RoPE (4, 6, 6)
SMALL = dict(hidden=64, depth=2, heads=4, frames=4, height=16, width=16, text_dim=32, text_len=8)


def _inputs(cfg, b=2, frames=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, cfg.in_channels, frames or cfg.frames, cfg.height, cfg.width, generator=g)
    ctx = torch.randn(b, cfg.text_len, cfg.text_dim, generator=g)
    mask = torch.arange(cfg.text_len)[None] < torch.tensor([[3], [cfg.text_len]])[:b]
    return x, torch.rand(b, generator=g), ctx, mask


def _perturbed(model, std=0.05, seed=1):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(std * torch.randn_like(p))
    return model


def test_presets_tokens_and_config_checks():
    tiny = video_dit_config("tiny")
    assert tiny.grid() == (4, 8, 8) and tiny.num_tokens == 256 and tiny.tokens(frames=1) == 64
    assert video_dit_config("S").num_tokens == 5 * 16 * 16
    xl = video_dit_config("XL")
    assert (xl.frames, xl.height, xl.width, xl.in_channels) == (33, 90, 160, 16)
    assert xl.num_tokens == 33 * 45 * 80 == 118_800 and xl.rope_axes == (32, 48, 48)
    assert 1.0e6 < sum(p.numel() for p in VideoDiT(tiny).parameters()) < 2.0e6
    with pytest.raises(ValueError):
        video_dit_config("tiny", nonsense=1)
    with pytest.raises(ValueError):
        VideoDiT(video_dit_config("tiny", **SMALL, rope_axes_dim=(4, 4, 6)))  # sums to 14, head dim 16
    with pytest.raises(ValueError):
        VideoDiT(video_dit_config("tiny", **SMALL, rope_axes_dim=(2, 7, 7)))  # odd
    with pytest.raises(ValueError):
        VideoDiT(video_dit_config("tiny", **SMALL, attention="windowed"))
    VideoDiT(video_dit_config("tiny", **SMALL, rope_axes_dim=(8, 4, 4)))


@pytest.mark.parametrize("head_dim", [8, 16, 32, 48, 64, 72, 96, 128])
def test_default_rope_axes_rule(head_dim):
    t, h, w = default_rope_axes(head_dim)
    assert t + h + w == head_dim and h == w and all(a > 0 and a % 2 == 0 for a in (t, h, w))
    assert t >= head_dim // 4 and h == 2 * (3 * head_dim // 16)


def test_rope_table_positions():
    model = VideoDiT(video_dit_config("tiny", **SMALL))
    dt, dh, dw = model.cfg.rope_axes
    gt, gh, gw = 3, 4, 5
    cos, sin = model.rope(gt, gh, gw)
    assert cos.shape == sin.shape == (gt * gh * gw, model.cfg.head_dim)
    # The first frequency of each axis is 1 rad per step: its angle is the integer coordinate.
    angle = torch.atan2(sin, cos)
    for t in range(gt):
        for h in range(gh):
            for w in range(gw):
                i = (t * gh + h) * gw + w
                for ch, coord in ((0, t), (dt // 2, h), ((dt + dh) // 2, w)):
                    ref = math.atan2(math.sin(coord), math.cos(coord))
                    assert angle[i, ch].item() == pytest.approx(ref, abs=1e-5)
                    assert angle[i, ch + model.cfg.head_dim // 2].item() == pytest.approx(ref, abs=1e-5)
    assert grid_positions(gt, gh, gw)[(1 * gh + 2) * gw + 3].tolist() == [1, 2, 3]


def test_patchify3d_round_trip_and_image_layout():
    x = torch.randn(2, 3, 6, 8, 12)
    tok = patchify3d(x, 2, 4)
    assert tok.shape == (2, 3 * 2 * 3, 2 * 4 * 4 * 3)
    assert torch.equal(unpatchify3d(tok, (3, 2, 3), 2, 4, 3), x)
    img = torch.randn(2, 3, 8, 12)
    assert torch.equal(patchify3d(img[:, :, None], 1, 4), patchify(img, 4))  # tp=1, T=1 = 2-D layout
    with pytest.raises(ValueError):
        patchify3d(x, 4, 4)


def test_patch_embed_conv_equals_linear():
    conv, lin = VideoPatchEmbed(3, 16, 4, 2, "conv"), VideoPatchEmbed(3, 16, 4, 2, "linear")
    with torch.no_grad():
        lin.proj.weight.copy_(conv.proj.weight.permute(0, 2, 3, 4, 1).reshape(16, -1))
        lin.proj.bias.copy_(conv.proj.bias)
    x = torch.randn(2, 3, 4, 8, 8)
    torch.testing.assert_close(conv(x), lin(x), rtol=1e-5, atol=1e-5)
    assert conv(x).is_contiguous()  # token-major memory, as the linear mode gives


@pytest.mark.parametrize("attention", ["full", "factorized"])
def test_shapes_video_image_and_zero_init(attention):
    cfg = video_dit_config("tiny", **SMALL, attention=attention)
    torch.manual_seed(0)
    model = VideoDiT(cfg)
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == cfg.depth
    for frames in (4, 3, 1):  # a multiple of tp, padded (3 -> 4), an image (1 -> 2)
        x, t, ctx, mask = _inputs(cfg, frames=frames)
        out = model(x, t, ctx, mask)
        assert out.shape == x.shape and torch.all(out == 0)  # zero final layer
        assert model.grid(x) == (math.ceil(frames / 2), 4, 4)
    img = x[:, :, 0]
    assert model(img, t, ctx, mask).shape == img.shape  # (B, C, H, W) accepted as one frame
    _perturbed(model)
    out = model(x, t, ctx, mask)
    assert torch.isfinite(out).all() and out.abs().sum() > 0
    # An image is its frame repeated tp times; the output keeps the last (real) frame.
    rep = model(x.expand(-1, -1, 2, -1, -1), t, ctx, mask)
    torch.testing.assert_close(out, rep[:, :, -1:])
    torch.testing.assert_close(model(img, t, ctx, mask), out[:, :, 0])


@pytest.mark.parametrize("attention", ["full", "factorized"])
def test_gradients_reach_every_parameter(attention):
    cfg = video_dit_config("tiny", **SMALL, attention=attention)
    torch.manual_seed(0)
    model = VideoDiT(cfg)
    x, t, ctx, mask = _inputs(cfg)
    model(x, t, ctx, mask).square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    _perturbed(model, 0.02)
    model.zero_grad()
    model(x, t, ctx, mask).square().mean().backward()
    for name, p in model.named_parameters():
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("axis", ["spatial", "temporal"])
def test_factorized_attention_equals_explicit_reshape(axis):
    """Full 3-D RoPE then regrouping == regrouping then RoPE over only the grouped axes."""
    torch.manual_seed(0)
    model = VideoDiT(video_dit_config("tiny", **SMALL))
    attn = SelfAttention(64, 4)
    b, (gt, gh, gw) = 2, (3, 2, 4)
    s = gh * gw
    x = torch.randn(b, gt * s, 64)
    attn.attn_impl = impl = FactorizedAttention(axis)
    impl.frames = gt
    out = attn(x, rope=model.rope(gt, gh, gw))
    attn.attn_impl = None
    xs = x.view(b, gt, s, 64)
    if axis == "spatial":  # every frame on its own, spatial RoPE (t = 0)
        ref = attn(xs.reshape(b * gt, s, 64), rope=model.rope(1, gh, gw)).view(b, gt, s, 64)
    else:  # every spatial position on its own, temporal RoPE (h = w = 0)
        ref = attn(xs.transpose(1, 2).reshape(b * s, gt, 64), rope=model.rope(gt, 1, 1))
        ref = ref.view(b, s, gt, 64).transpose(1, 2)
    torch.testing.assert_close(out, ref.reshape(b, gt * s, 64), rtol=1e-5, atol=1e-5)
    full = attn(x, rope=model.rope(gt, gh, gw))
    assert not torch.allclose(out, full, atol=1e-3)  # factorized is really not full attention


def test_image_tokens_match_text2image_dit_embedding():
    """abs_pos='spatial' with tp=1: an image gets exactly the T2I DiT's token embedding."""
    torch.manual_seed(0)
    video = VideoDiT(video_dit_config("tiny", **SMALL, temporal_patch=1))
    dit = DiT(dit_config("tiny", hidden=64, depth=2, heads=4, img_size=16, text_dim=32, patch_embed="linear"))
    dit.patch_embed.load_state_dict(video.patch_embed.state_dict())
    img = torch.randn(2, 3, 16, 16)
    t, ctx = torch.rand(2), torch.randn(2, 8, 32)
    dit.caption_proj.load_state_dict(video.caption_proj.state_dict())
    torch.testing.assert_close(video.embed(img[:, :, None], t, ctx)[0], dit.embed(img, t, ctx)[0])


@pytest.mark.parametrize("abs_pos", ["spatial", "3d", "none"])
def test_abs_pos_option_reaches_the_model(abs_pos):
    """model.abs_pos from the run config builds that table: only '3d' tells the frames apart."""
    import os
    from common.config import build_config
    from pipelines.text2video import components
    from pipelines.text2video.config import T2VConfig
    yaml = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pipelines/text2video/configs/tiny.yaml")
    model = components.build(build_config(T2VConfig, yaml, [f"model.abs_pos={abs_pos}"])).model
    assert model.cfg.abs_pos == abs_pos
    pos = model.pos_embed((4, 8, 8))
    if abs_pos == "none":
        assert pos is None
        return
    frames = pos.view(4, 64, -1)
    assert not torch.allclose(frames[0], frames[1]) if abs_pos == "3d" else torch.equal(frames[0], frames[3])


@pytest.mark.parametrize("overrides", [dict(attention="full"), dict(attention="factorized"),
                                       dict(attention="full", frames=8, temporal_patch=1, patch_size=8)])
def test_flops_estimate_matches_flop_counter(overrides):
    cfg = video_dit_config("tiny", **{**SMALL, **overrides})
    model = VideoDiT(cfg)
    x, t, ctx, mask = _inputs(cfg)
    with use_backend("reference"), FlopCounterMode(display=False) as fc, torch.no_grad():
        model(x, t, ctx, mask)
    measured = fc.get_total_flops() / 2
    assert measured == pytest.approx(model.flops_per_sample(), rel=0.10)
    assert video_dit_flops(cfg) == model.flops_per_sample()
    assert video_dit_flops(cfg, frames=1) < video_dit_flops(cfg)
