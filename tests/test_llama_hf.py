"""Hugging Face interop of the Llama decoder (common/nn/llama_hf.py) against transformers itself:
tiny random HF models built from configs (no hub, no network), fp32 on CPU."""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from common.nn.generate import greedy_generate  # noqa: E402
from common.nn.llama import Llama, LlamaConfig  # noqa: E402
from common.nn.llama_hf import (  # noqa: E402
    from_hf_state_dict,
    hf_config,
    llama_config_from_hf,
    load_hf_lm,
    save_hf_lm,
    to_hf_state_dict,
)

VOCAB = 96


def _hf_model(arch: str, *, kv_heads: int = 2, theta: float = 10000.0, tied: bool = False):
    """A tiny random HF causal LM whose every tensor (norms and biases included) is random, so a
    swapped or dropped tensor shows in the logits."""
    cls_cfg, cls = ((transformers.LlamaConfig, transformers.LlamaForCausalLM) if arch == "llama"
                    else (transformers.Qwen2Config, transformers.Qwen2ForCausalLM))
    cfg = cls_cfg(hidden_size=64, num_attention_heads=4, num_key_value_heads=kv_heads, num_hidden_layers=2,
                  intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": theta}, tie_word_embeddings=tied,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.5 if "embed" in name else p.shape[1] ** -0.5)
            else:  # RMSNorm weights around 1, biases around 0
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return model


def _ours_from_hf(hf_model) -> Llama:
    cfg = llama_config_from_hf(hf_model.config)
    ours = Llama(cfg).eval()
    ours.load_state_dict(from_hf_state_dict(hf_model.state_dict(), cfg,
                                            tie_word_embeddings=hf_model.config.tie_word_embeddings))
    return ours


def _max_diff(ours: Llama, hf_model, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return (ours(tokens) - hf_model(tokens).logits).abs().max().item()


CASES = {"llama-gqa-theta5e5": dict(arch="llama", kv_heads=2, theta=5e5),
         "llama-mha": dict(arch="llama", kv_heads=4),
         "qwen2-gqa-bias": dict(arch="qwen2", kv_heads=2, theta=1e6),
         "qwen2-tied": dict(arch="qwen2", kv_heads=1, tied=True)}


@pytest.mark.parametrize("case", CASES)
def test_state_dict_round_trips_and_logits(case):
    kw = CASES[case]
    hf_model = _hf_model(**kw)
    ours = _ours_from_hf(hf_model)
    cfg = ours.cfg
    assert (cfg.kv_heads, cfg.qkv_bias, cfg.rope_theta) == (kw["kv_heads"], kw["arch"] == "qwen2",
                                                             kw.get("theta", 10000.0))
    # HF -> ours -> HF: every tensor bit for bit (a tied HF state dict lists lm_head as the embedding).
    ref = hf_model.state_dict()
    back = to_hf_state_dict(ours, kw["arch"])
    assert set(back) == set(ref)
    for k in ref:
        assert torch.equal(back[k], ref[k]), k
    # ours -> HF -> ours: bit for bit, and the head is its own tensor even when loaded tied.
    again = from_hf_state_dict(to_hf_state_dict(ours, kw["arch"]), cfg)
    assert set(again) == set(ours.state_dict())
    for k, v in ours.state_dict().items():
        assert torch.equal(again[k], v), k
    assert ours.output.weight.data_ptr() != ours.tok_embeddings.weight.data_ptr()
    # Same function: logits against transformers' forward on the same weights (positions well
    # past 0 so that the RoPE base matters).
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    diff = _max_diff(ours, hf_model, tokens)
    print(f"{case}: max |logits ours - transformers| = {diff:.2e}")
    assert diff <= 1e-4


def test_config_round_trip_and_legacy_rope_fields():
    cfg = LlamaConfig(dim=64, n_layers=3, n_heads=8, n_kv_heads=2, vocab_size=100, ffn_hidden=160,
                      norm_eps=1e-5, rope_theta=123456.0, max_seq_len=512)
    hf = hf_config(cfg, "llama", eos_token_id=7)
    assert (hf.model_type, hf.architectures, hf.eos_token_id, hf.tie_word_embeddings) == \
        ("llama", ["LlamaForCausalLM"], 7, False)
    assert llama_config_from_hf(hf) == cfg
    assert llama_config_from_hf(json.loads(hf.to_json_string())) == cfg
    qcfg = LlamaConfig(**{**cfg.__dict__, "qkv_bias": True})
    assert llama_config_from_hf(hf_config(qcfg, "qwen2")) == qcfg
    # transformers 4 layout: top-level rope_theta, rope_scaling null, no head_dim.
    legacy = {k: v for k, v in hf.to_dict().items() if k not in ("rope_parameters", "head_dim")}
    legacy.update(rope_theta=123456.0, rope_scaling=None)
    assert llama_config_from_hf(legacy) == cfg


def _tokenizer_dir(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    path.mkdir()
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "</s>"}))
    return path


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_save_hf_lm_loads_in_transformers(tmp_path, arch):
    torch.manual_seed(0)
    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, ffn_hidden=96,
                      rope_theta=5e4, max_seq_len=64, qkv_bias=arch == "qwen2")
    ours = Llama(cfg).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    out = tmp_path / "export"
    save_hf_lm(ours, out, arch=arch, tokenizer_dir=_tokenizer_dir(tmp_path / "tok"), eos_token_id=1, pad_token_id=0)
    gen_cfg = json.loads((out / "generation_config.json").read_text())
    assert (gen_cfg["eos_token_id"], gen_cfg["pad_token_id"]) == (1, 0)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf_model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert hf_model.dtype == torch.float32
    tokens = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(2))
    diff = _max_diff(ours, hf_model, tokens)
    print(f"save_hf_lm {arch}: max |logits ours - transformers| = {diff:.2e}")
    assert diff <= 1e-4
    # Greedy decoding: 8 tokens each, eos disabled on the HF side so that neither stops early.
    hf_model.generation_config.eos_token_id = None
    prompts = [tokens[0, :5], tokens[1, :11]]
    ref = greedy_generate(ours, prompts, max_new_tokens=8)
    for prompt, expect in zip(prompts, ref):
        got = hf_model.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), do_sample=False,
                                max_new_tokens=8)
        assert got[0, len(prompt):].tolist() == expect
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.convert_tokens_to_ids(["w3", "w5"]) == [5, 7] and tok.eos_token_id == 1
    if arch == "llama":  # transformers 5 gives qwen2 folders its byte-level Qwen2Tokenizer pipeline
        assert tok("w3 w5").input_ids == [5, 7]
    # And back: our loader reproduces the exported model bit for bit.
    again = load_hf_lm(out)
    assert again.cfg == cfg
    for k, v in ours.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


@pytest.mark.parametrize("fmt", ["save_pretrained", "sharded", "bin"])
def test_load_hf_lm_formats(tmp_path, fmt):
    hf_model = _hf_model("qwen2", kv_heads=2, tied=True)
    if fmt == "bin":
        hf_model.config.save_pretrained(tmp_path)
        torch.save(hf_model.state_dict(), tmp_path / "pytorch_model.bin")
    else:
        hf_model.save_pretrained(tmp_path, **({"max_shard_size": "40KB"} if fmt == "sharded" else {}))
        assert (tmp_path / "model.safetensors.index.json").is_file() == (fmt == "sharded")
    ours = load_hf_lm(tmp_path)
    tokens = torch.randint(0, VOCAB, (1, 17), generator=torch.Generator().manual_seed(3))
    assert _max_diff(ours, hf_model, tokens) <= 1e-4
    assert torch.equal(ours.output.weight, hf_model.model.embed_tokens.weight)


def test_save_hf_lm_shards_and_bf16(tmp_path):
    ours = Llama(LlamaConfig(dim=32, n_layers=2, n_heads=4, vocab_size=VOCAB, ffn_hidden=48, max_seq_len=32))
    save_hf_lm(ours, tmp_path, dtype=torch.bfloat16, max_shard_bytes=8000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (tmp_path / "model.safetensors").exists()
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    back = load_hf_lm(tmp_path, dtype=None)
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v.to(torch.bfloat16)), k
    save_hf_lm(ours, tmp_path)  # re-export over it: the old shards go
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]


# ------------------------------------------------------------------------------------------ errors
def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no Hugging Face checkpoint folder at .*nowhere"):
        load_hf_lm(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_lm(tmp_path)
    hf_model = _hf_model("llama")
    hf_model.config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_hf_lm(tmp_path)
    from safetensors.torch import save_file
    sd = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    save_file({**sd, "model.layers.0.self_attn.extra.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensors .*model.layers.0.self_attn.extra.weight"):
        load_hf_lm(tmp_path)
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors .*model.layers.1.mlp.up_proj.weight"):
        load_hf_lm(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope_type='linear'"):
        load_hf_lm(tmp_path)


@pytest.mark.parametrize("change,needle", [
    (dict(model_type="gpt2"), "unsupported model_type 'gpt2'"),
    (dict(architectures=["LlamaModel"]), "unsupported architectures"),
    (dict(rope_parameters=None, rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_type='dynamic'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
    (dict(head_dim=32), "head_dim=32"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
])
def test_unsupported_llama_configs(change, needle):
    d = {**hf_config(LlamaConfig(dim=64, n_heads=4, n_layers=1, vocab_size=32, ffn_hidden=64)).to_dict(), **change}
    with pytest.raises(ValueError, match=needle):
        llama_config_from_hf(d)


def test_unsupported_qwen2_and_export_refusals():
    d = transformers.Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=4,
                                 use_sliding_window=True, sliding_window=16, max_window_layers=2).to_dict()
    with pytest.raises(ValueError, match="use_sliding_window"):
        llama_config_from_hf(d)
    cfg = LlamaConfig(dim=32, n_heads=4, n_layers=1, vocab_size=32, ffn_hidden=32)
    with pytest.raises(ValueError, match="qk_norm"):
        hf_config(LlamaConfig(**{**cfg.__dict__, "qk_norm": True}))
    with pytest.raises(ValueError, match="qkv_bias"):
        hf_config(LlamaConfig(**{**cfg.__dict__, "qkv_bias": True}), "llama")
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        hf_config(cfg, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="unsupported arch 'mistral'"):
        hf_config(cfg, "mistral")
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        hf_config(cfg, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                        "original_max_position_embeddings": 1024})
