"""Single-process checks of the Llama decoder: shapes, causality, GQA, config rules, hooks."""
from __future__ import annotations

import pytest
import torch

from common.nn import Llama, LlamaAttention, LlamaConfig


def _cfg(**kw) -> LlamaConfig:
    base = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=48, max_seq_len=16)
    return LlamaConfig(**{**base, **kw})


def test_shapes_and_hidden_states():
    torch.manual_seed(0)
    model = Llama(_cfg())
    tokens = torch.randint(0, 64, (3, 10))
    logits = model(tokens)
    assert logits.shape == (3, 10, 64)
    h = model.hidden_states(tokens)
    assert h.shape == (3, 10, 32)
    torch.testing.assert_close(model.output(h), logits)
    # inputs_embeds is the same path as tokens (how a VLM splices image features in).
    torch.testing.assert_close(model(inputs_embeds=model.tok_embeddings(tokens)), logits)
    a = model.blocks[0].attention
    assert (a.to_q.out_features, a.to_k.out_features, a.to_v.out_features, a.proj.in_features) == (32, 16, 16, 32)


def test_causal_future_tokens_do_not_change_past_logits():
    torch.manual_seed(0)
    model = Llama(_cfg(qk_norm=True)).double()
    tokens = torch.randint(0, 64, (2, 12))
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 64
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-12)
    assert (a[:, 7:] - b[:, 7:]).abs().max() > 1e-3


def test_gqa_equals_mha_with_repeated_kv_heads():
    """Query head h reads kv head h // (Hq / Hkv): an MHA layer whose k/v weights repeat each
    kv head's rows for its query group gives the same output."""
    torch.manual_seed(0)
    dim, hq, hkv = 32, 4, 2
    hd, group = dim // hq, hq // hkv
    gqa = LlamaAttention(dim, hq, hkv).double()
    mha = LlamaAttention(dim, hq, hq).double()
    with torch.no_grad():
        for name in ("to_q", "proj"):
            getattr(mha, name).weight.copy_(getattr(gqa, name).weight)
        for name in ("to_k", "to_v"):
            w = getattr(gqa, name).weight.view(hkv, hd, dim).repeat_interleave(group, dim=0)
            getattr(mha, name).weight.copy_(w.reshape(hq * hd, dim))
    x = torch.randn(2, 9, dim, dtype=torch.float64)
    rope = Llama(_cfg()).rope(9)
    torch.testing.assert_close(gqa(x, rope), mha(x, rope), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kw,needle", [(dict(n_heads=4, n_kv_heads=3), "n_heads 4 not a multiple of n_kv_heads 3"),
                                        (dict(dim=30, n_heads=4), "dim 30 not divisible by n_heads 4"),
                                        (dict(dim=12, n_heads=4, n_kv_heads=4), "head dim 3 must be even")])
def test_config_validation(kw, needle):
    with pytest.raises(ValueError, match=needle):
        _cfg(**kw)


def test_ffn_rule_and_defaults():
    # Llama rule: 2/3 * 4 * dim rounded up to multiple_of (4096 -> 11008 with multiple_of 256).
    assert LlamaConfig(dim=4096, n_heads=32, multiple_of=256).ffn_dim == 11008
    assert LlamaConfig(dim=4096, n_heads=32, multiple_of=1024, ffn_dim_multiplier=1.3).ffn_dim == 14336
    assert LlamaConfig(dim=64, n_heads=4).kv_heads == 4
    assert _cfg(ffn_hidden=40).ffn_dim == 40


def test_max_seq_len_and_input_checks():
    model = Llama(_cfg())
    with pytest.raises(ValueError, match="sequence length 17 exceeds max_seq_len 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="exactly one"):
        model()


def test_attn_impl_hook_receives_gqa_heads():
    """Context parallelism replaces attention through attn_impl; it sees Hq query heads and Hkv
    kv heads, causal=True."""
    from common.kernels import attention
    model = Llama(_cfg(n_layers=1))
    seen = []

    def impl(q, k, v, **kw):
        seen.append((q.shape[1], k.shape[1], kw["causal"]))
        return attention(q, k, v, **kw)
    tokens = torch.randint(0, 64, (1, 6))
    ref = model(tokens)
    model.blocks[0].attention.attn_impl = impl
    torch.testing.assert_close(model(tokens), ref)
    assert seen == [(4, 2, True)]


def test_backward_reaches_every_parameter():
    torch.manual_seed(0)
    model = Llama(_cfg(qk_norm=True))
    tokens = torch.randint(0, 64, (2, 8))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    assert abs(loss.item() - torch.log(torch.tensor(64.0)).item()) < 1.5  # near-uniform start
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
