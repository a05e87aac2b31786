"""Llama <-> megatron-core GPTModel weight conversion (common/nn/llama_megatron.py). The converters
need no megatron; the GPTModel comparison at the end needs CUDA and megatron-core."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.kernels import apply_rope
from common.nn.llama import Llama, LlamaConfig
from common.nn.llama_megatron import (
    build_megatron_gpt,
    detect_spec,
    from_megatron_state_dict,
    fuse_qkv,
    merge_megatron_state_dicts,
    shard_megatron_state_dict,
    split_qkv,
    to_megatron_state_dict,
)


def _model(**kw) -> Llama:
    base = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=48, max_seq_len=32)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**{**base, **kw}))
    with torch.no_grad():  # random norms and biases too, so that a swap shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return model


CASES = {"gqa": dict(n_kv_heads=2), "mha": dict(n_kv_heads=None),
         "mqa-bias-qknorm": dict(n_kv_heads=1, qkv_bias=True, qk_norm=True)}


@pytest.mark.parametrize("spec", ["te", "local"])
@pytest.mark.parametrize("case", CASES)
def test_round_trip_bit_for_bit(spec, case):
    model = _model(**CASES[case])
    cfg = model.cfg
    meg = to_megatron_state_dict(model, spec=spec)
    layer = {k.removeprefix("decoder.layers.1.") for k in meg if k.startswith("decoder.layers.1.")}
    norms = ({"self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"} if spec == "te"
             else {"input_layernorm.weight", "pre_mlp_layernorm.weight"})
    extra = ({"self_attention.linear_qkv.bias", "self_attention.q_layernorm.weight",
              "self_attention.k_layernorm.weight"} if cfg.qkv_bias else set())
    assert layer == norms | extra | {"self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                                     "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"}
    assert {k for k in meg if not k.startswith("decoder.layers.")} == {
        "embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"}
    hd = cfg.head_dim
    assert meg["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((cfg.n_heads + 2 * cfg.kv_heads) * hd,
                                                                             cfg.dim)
    assert detect_spec(meg) == spec
    back = from_megatron_state_dict(meg, cfg, spec)
    ref = model.state_dict()
    assert set(back) == set(ref)
    for k, v in ref.items():
        assert torch.equal(back[k], v), k
    # Loads into a fresh model; TE's _extra_state entries are skipped.
    meg["decoder.layers.0.self_attention.linear_qkv._extra_state"] = torch.empty(0)
    fresh = Llama(cfg)
    fresh.load_state_dict(from_megatron_state_dict(meg, cfg, "auto"))
    tokens = torch.randint(0, 64, (1, 9))
    assert torch.equal(fresh(tokens), model(tokens))


def test_fused_qkv_layout_by_hand():
    """4 query heads, 2 kv heads (groups of r=2), head dim 2: row ids tagged q=100+, k=200+, v=300+."""
    hq, hkv, hd, dim = 4, 2, 2, 3
    q = (100 + torch.arange(hq * hd)).float()[:, None].expand(-1, dim)
    k = (200 + torch.arange(hkv * hd)).float()[:, None].expand(-1, dim)
    v = (300 + torch.arange(hkv * hd)).float()[:, None].expand(-1, dim)
    fused = fuse_qkv(q, k, v, hq, hkv)
    assert fused[:, 0].long().tolist() == [100, 101, 102, 103, 200, 201, 300, 301,   # group 0: q heads 0-1, k0, v0
                                           104, 105, 106, 107, 202, 203, 302, 303]   # group 1: q heads 2-3, k1, v1
    # k head of group 1 starts at row g * (r + 2) * hd + r * hd = 1 * 4 * 2 + 2 * 2 = 12.
    assert torch.equal(fused[12:14], k[2:4])
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, hq, hkv), (q, k, v)))
    bias = fuse_qkv(q[:, 0], k[:, 0], v[:, 0], hq, hkv)
    assert torch.equal(bias, fused[:, 0])
    # SwiGLU: fc1 = [gate (w1); up (w3)].
    model = _model()
    meg = to_megatron_state_dict(model, spec="local")
    fc1 = meg["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:48], model.blocks[0].mlp.w1.weight) and torch.equal(fc1[48:], model.blocks[0].mlp.w3.weight)


def test_megatron_semantics_reproduce_our_layer():
    """Megatron's computation written out on the converted tensors (view the qkv projection as
    (.., G, (r + 2) * hd), split [r * hd, hd, hd]; glu = silu(first half) * second half) gives our
    block's output."""
    model = _model(n_heads=8, n_kv_heads=2, qkv_bias=True).double()
    cfg, block = model.cfg, model.blocks[1]
    meg = {k: v.double() for k, v in to_megatron_state_dict(model, spec="te").items()}
    p = "decoder.layers.1."
    g, r, hd = cfg.kv_heads, cfg.n_heads // cfg.kv_heads, cfg.head_dim
    x = torch.randn(2, 7, cfg.dim, dtype=torch.float64)
    rope = tuple(t.double() for t in model.rope(7))

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w

    h = rms(x, meg[p + "self_attention.linear_qkv.layer_norm_weight"])
    mixed = F.linear(h, meg[p + "self_attention.linear_qkv.weight"], meg[p + "self_attention.linear_qkv.bias"])
    q, k, v = mixed.view(2, 7, g, (r + 2) * hd).split([r * hd, hd, hd], dim=3)
    q = q.reshape(2, 7, g * r, hd).transpose(1, 2)  # query head h belongs to group h // r
    k, v = (t.repeat_interleave(r, dim=2).transpose(1, 2) for t in (k, v))
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 7, -1)
    x1 = x + F.linear(attn, meg[p + "self_attention.linear_proj.weight"])
    h = rms(x1, meg[p + "mlp.linear_fc1.layer_norm_weight"])
    gate, up = F.linear(h, meg[p + "mlp.linear_fc1.weight"]).chunk(2, -1)
    out = x1 + F.linear(F.silu(gate) * up, meg[p + "mlp.linear_fc2.weight"])
    torch.testing.assert_close(out, block(x, rope), rtol=1e-10, atol=1e-10)


def test_tensor_parallel_shards():
    model = _model(n_heads=8, n_kv_heads=4)
    cfg = model.cfg
    full = to_megatron_state_dict(model, spec="te")
    shards = [shard_megatron_state_dict(full, cfg, 2, rank) for rank in range(2)]
    merged = merge_megatron_state_dicts(shards)
    assert all(torch.equal(merged[k], v) for k, v in full.items()) and set(merged) == set(full)
    # Rank 1 holds kv groups 2-3 (whole groups, q heads 4-7) and the second halves of gate and up.
    a, mlp, hd = model.blocks[0].attention, model.blocks[0].mlp, cfg.head_dim
    qkv1 = shards[1]["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = split_qkv(qkv1, 4, 2)
    assert torch.equal(q, a.to_q.weight[4 * hd:]) and torch.equal(k, a.to_k.weight[2 * hd:])
    fc1 = shards[1]["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([mlp.w1.weight[24:], mlp.w3.weight[24:]]))
    assert torch.equal(shards[1]["decoder.layers.0.mlp.linear_fc2.weight"], mlp.w2.weight[:, 24:])
    assert torch.equal(shards[1]["decoder.final_layernorm.weight"], model.norm.weight)
    with pytest.raises(ValueError, match="divisible by the tensor-parallel size 3"):
        shard_megatron_state_dict(full, cfg, 3, 0)


def test_errors_and_padded_vocab():
    model = _model()
    cfg = model.cfg
    meg = to_megatron_state_dict(model, spec="te")
    with pytest.raises(ValueError, match="missing key 'decoder.layers.0.input_layernorm.weight'"):
        from_megatron_state_dict(meg, cfg, "local")
    with pytest.raises(ValueError, match="unexpected keys .*decoder.layers.2.mlp.linear_fc2.weight"):
        from_megatron_state_dict({**meg, "decoder.layers.2.mlp.linear_fc2.weight": torch.zeros(1)}, cfg)
    with pytest.raises(ValueError, match="unknown megatron layer spec 'fused'"):
        to_megatron_state_dict(model, spec="fused")
    padded = dict(meg)
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        padded[key] = torch.cat([meg[key], torch.zeros(64, cfg.dim)])  # megatron-training pads the vocabulary
    with pytest.raises(ValueError, match="128 vocabulary rows, config says 64 .*padded_vocab=True"):
        from_megatron_state_dict(padded, cfg)
    back = from_megatron_state_dict(padded, cfg, padded_vocab=True)
    assert torch.equal(back["output.weight"], model.output.weight)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_build_megatron_gpt_needs_cuda():
    with pytest.raises(RuntimeError, match="CUDA"):
        build_megatron_gpt(_model().cfg)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="megatron-core's GPTModel needs CUDA")
@pytest.mark.parametrize("spec", ["te", "local"])
def test_megatron_gpt_logits_match(spec):
    pytest.importorskip("megatron.core")
    if spec == "te":
        pytest.importorskip("transformer_engine")
    from common.nn.llama_megatron import load_megatron_state_dict
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model(n_heads=4, n_kv_heads=2).cuda().eval()
    gpt = build_megatron_gpt(model.cfg, spec=spec, dtype=torch.float32, parallel_output=False).eval()
    load_megatron_state_dict(gpt, model, spec=spec)
    tokens = torch.randint(0, 64, (2, 16), device="cuda")
    positions = torch.arange(16, device="cuda").expand(2, -1)
    with torch.no_grad():
        ours, theirs = model(tokens), gpt(tokens, positions, None)
    assert theirs.shape == ours.shape
    torch.testing.assert_close(theirs.float(), ours, rtol=1e-3, atol=1e-3)
