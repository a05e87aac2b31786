"""Hugging Face interop for the Llama decoder (common/nn/llama.py): configs, state dicts, folders.

Two HF architectures map onto `Llama` exactly:

    arch     HF classes                         extra over a plain Llama
    llama    LlamaConfig / LlamaForCausalLM     -
    qwen2    Qwen2Config / Qwen2ForCausalLM     q/k/v biases (LlamaConfig.qkv_bias=True)

Parameter names (per layer i; ours -> HF, `model.` prefix on everything but lm_head):

    tok_embeddings.weight                  model.embed_tokens.weight
    blocks.i.attention_norm.weight         model.layers.i.input_layernorm.weight
    blocks.i.attention.to_{q,k,v}.weight   model.layers.i.self_attn.{q,k,v}_proj.weight   (.bias: qwen2)
    blocks.i.attention.proj.weight         model.layers.i.self_attn.o_proj.weight
    blocks.i.ffn_norm.weight               model.layers.i.post_attention_layernorm.weight
    blocks.i.mlp.w1.weight                 model.layers.i.mlp.gate_proj.weight   (silu branch)
    blocks.i.mlp.w3.weight                 model.layers.i.mlp.up_proj.weight
    blocks.i.mlp.w2.weight                 model.layers.i.mlp.down_proj.weight
    norm.weight                            model.norm.weight
    output.weight                          lm_head.weight

No tensor is permuted: HF checkpoints store q/k rows in the rotate-half RoPE order (the HF
conversion script permutes Meta's interleaved layout once, at conversion), and common.kernels.rope
is rotate-half too, so the maps are pure renames and round trips are bit for bit.

Tied embeddings (tie_word_embeddings=True, e.g. small Qwen2): our model always keeps a separate
`output`; loading copies the embedding into it, and exporting writes both tensors with
tie_word_embeddings=False (exact, and the two may diverge once trained).

Loading (`load_hf_lm`) reads config.json with the json module and the weights with safetensors
(or torch.load for pytorch_model.bin): it never imports transformers. Writing (`hf_config`,
`save_hf_lm`) uses transformers' config classes so the files follow its conventions.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from .llama import Llama, LlamaConfig

ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# Defaults of the transformers config classes for fields a config.json may omit.
_DEFAULTS = {
    "llama": dict(num_key_value_heads=None, rms_norm_eps=1e-6, max_position_embeddings=2048,
                  tie_word_embeddings=False, hidden_act="silu"),
    "qwen2": dict(num_key_value_heads=32, rms_norm_eps=1e-6, max_position_embeddings=32768,
                  tie_word_embeddings=False, hidden_act="silu"),
}

# Files a tokenizer folder may hold (save_pretrained's names); copied verbatim by save_hf_lm.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja",
                    "chat_template.json")
_TOKENIZER_VOCABS = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")

# Ours -> HF per-layer suffixes.
_LAYER_MAP = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.to_q.weight": "self_attn.q_proj.weight",
    "attention.to_q.bias": "self_attn.q_proj.bias",
    "attention.to_k.weight": "self_attn.k_proj.weight",
    "attention.to_k.bias": "self_attn.k_proj.bias",
    "attention.to_v.weight": "self_attn.v_proj.weight",
    "attention.to_v.bias": "self_attn.v_proj.bias",
    "attention.proj.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
}
_TOP_MAP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}
_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"


# ---------------------------------------------------------------------------------------- configs
def _arch(arch: str) -> str:
    if arch not in ARCHS:
        raise ValueError(f"unsupported arch {arch!r}: expected one of {sorted(ARCHS)}")
    return arch


def _check_exportable(cfg: LlamaConfig, arch: str) -> None:
    if cfg.qk_norm:
        raise ValueError(f"LlamaConfig.qk_norm=True has no place in HF arch {arch!r} (no q/k norms)")
    if arch == "llama" and cfg.qkv_bias:
        raise ValueError("LlamaConfig.qkv_bias=True cannot be exported as arch 'llama' (HF Llama's "
                         "attention_bias also biases o_proj); use arch='qwen2'")
    if arch == "qwen2" and not cfg.qkv_bias:
        raise ValueError("arch 'qwen2' always has q/k/v biases; export a LlamaConfig with qkv_bias=False "
                         "as arch='llama'")


def hf_config(cfg: LlamaConfig, arch: str = "llama", **extra):
    """LlamaConfig -> transformers LlamaConfig / Qwen2Config (architectures set, untied head,
    default RoPE, no bos/eos/pad ids unless given in `extra`, which overrides any field)."""
    import transformers

    _check_exportable(cfg, _arch(arch))
    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
              num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
              hidden_act="silu", max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
              rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
              tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
              architectures=[ARCHS[arch]])
    if arch == "llama":
        kw.update(attention_bias=False, mlp_bias=False, head_dim=cfg.head_dim)
        cls = transformers.LlamaConfig
    else:
        kw.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
        cls = transformers.Qwen2Config
    kw.update(extra)
    out = cls(**kw)
    llama_config_from_hf(out)  # `extra` must not ask for something our model cannot do
    if out.tie_word_embeddings:
        raise ValueError("tie_word_embeddings=True is not supported on export: our output head is its own "
                         "tensor, which a tied HF model would replace by the embedding")
    return out


def _rope_theta(d: dict) -> float:
    """rope_theta from a config dict, refusing any RoPE variant but the default. transformers 5
    keeps RoPE in `rope_parameters` (rope_type, rope_theta, ...; per layer type for some models);
    older configs have top-level `rope_theta` and `rope_scaling` (None for default)."""
    params = d.get("rope_parameters")
    if params is None:
        params = dict(d.get("rope_scaling") or {})
        params.setdefault("rope_theta", d.get("rope_theta", 10000.0))
    elif params and all(isinstance(v, Mapping) for v in params.values()):  # {layer_type: params}
        kinds = [dict(v) for v in params.values()]
        if any(k != kinds[0] for k in kinds):
            raise ValueError(f"rope_parameters differ per layer type ({sorted(params)}); unsupported")
        params = kinds[0]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in (None, "default"):
        raise ValueError(f"rope_parameters.rope_type={rope_type!r} (RoPE scaling) is not supported: "
                         "only default RoPE")
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported: RoPE must cover the whole head")
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    return float(theta)


def _config_dict(hf_cfg) -> dict:
    return dict(hf_cfg.to_dict() if hasattr(hf_cfg, "to_dict") else hf_cfg)


def llama_config_from_hf(hf_cfg) -> LlamaConfig:
    """transformers LlamaConfig / Qwen2Config, or a config.json dict -> LlamaConfig. ValueError,
    naming the field, for anything LlamaConfig cannot represent."""
    d = _config_dict(hf_cfg)
    arch = d.get("model_type")
    if arch not in ARCHS:
        raise ValueError(f"unsupported model_type {arch!r}: expected one of {sorted(ARCHS)}")
    archs = d.get("architectures") or [ARCHS[arch]]
    if list(archs) != [ARCHS[arch]]:
        raise ValueError(f"unsupported architectures {archs}: expected [{ARCHS[arch]!r}]")
    # Absent fields take the transformers class defaults; an explicit null num_key_value_heads
    # means multi-head attention (as in the config classes' __post_init__).
    d = {**_DEFAULTS[arch], **d}
    for key, default in _DEFAULTS[arch].items():
        if d[key] is None and key != "num_key_value_heads":
            d[key] = default
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if d.get(key) is None:
            raise ValueError(f"config lacks {key!r}")
    if d["hidden_act"] != "silu":
        raise ValueError(f"hidden_act={d['hidden_act']!r} is not supported: SwiGLU needs 'silu'")
    if d.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported: the SwiGLU projections have no bias")
    if arch == "llama" and d.get("attention_bias"):
        raise ValueError("attention_bias=True is not supported for llama: HF Llama then biases o_proj too")
    if arch == "qwen2":
        if d.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True is not supported: attention is full causal")
        layer_types = d.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"layer_types {sorted(set(layer_types))} is not supported: only full_attention")
    dim, heads = d["hidden_size"], d["num_attention_heads"]
    if dim % heads:
        raise ValueError(f"hidden_size {dim} is not divisible by num_attention_heads {heads}")
    head_dim = d.get("head_dim")
    if head_dim is not None and head_dim != dim // heads:
        raise ValueError(f"head_dim={head_dim} is not supported: it must be hidden_size / num_attention_heads "
                         f"= {dim // heads}")
    return LlamaConfig(dim=dim, n_layers=d["num_hidden_layers"], n_heads=heads,
                       n_kv_heads=d["num_key_value_heads"], vocab_size=d["vocab_size"],
                       ffn_hidden=d["intermediate_size"], norm_eps=float(d["rms_norm_eps"]),
                       rope_theta=_rope_theta(d), max_seq_len=d["max_position_embeddings"],
                       qkv_bias=arch == "qwen2")


def _tied(hf_cfg) -> bool:
    d = _config_dict(hf_cfg)
    tie = d.get("tie_word_embeddings")
    return bool(_DEFAULTS.get(d.get("model_type"), {}).get("tie_word_embeddings", False) if tie is None else tie)


# ------------------------------------------------------------------------------------ state dicts
def _to_hf_name(name: str) -> str:
    if name in _TOP_MAP:
        return _TOP_MAP[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blocks" and parts[2] in _LAYER_MAP:
        return f"model.layers.{parts[1]}.{_LAYER_MAP[parts[2]]}"
    raise ValueError(f"parameter {name!r} has no Hugging Face name")


def _expected(cfg: LlamaConfig) -> dict[str, torch.Size]:
    """Our state-dict names and shapes for cfg (from a parameter-less meta-device model)."""
    with torch.device("meta"):
        return {k: v.shape for k, v in Llama(cfg).state_dict().items()}


def to_hf_state_dict(model: Llama, arch: str = "llama") -> dict[str, torch.Tensor]:
    """Our (unsharded) model -> HF state dict: renamed, detached, no copies."""
    _check_exportable(model.cfg, _arch(arch))
    return {_to_hf_name(k): v.detach() for k, v in model.state_dict().items()}


def _names(names, limit: int = 8) -> str:
    names = sorted(names)
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def from_hf_state_dict(sd: Mapping[str, torch.Tensor], cfg: LlamaConfig, *,
                       tie_word_embeddings: bool | None = None) -> dict[str, torch.Tensor]:
    """HF state dict -> ours, for Llama(cfg).load_state_dict. tie_word_embeddings: True takes the
    output head from the embedding (as HF does), False requires lm_head.weight, None uses
    lm_head.weight when present and the embedding otherwise. ValueError naming missing or
    unexpected tensors and shape mismatches; rotary inv_freq buffers of old checkpoints are skipped."""
    expected = _expected(cfg)
    inverse = {_to_hf_name(k): k for k in expected}
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    if tie_word_embeddings or (tie_word_embeddings is None and _HEAD not in sd):
        sd.pop(_HEAD, None)
        if _EMBED in sd:
            sd[_HEAD] = sd[_EMBED].clone()  # our head is its own parameter, never an alias
    unexpected = [k for k in sd if k not in inverse]
    if unexpected:
        raise ValueError(f"unexpected tensors in the Hugging Face state dict: {_names(unexpected)}")
    missing = [k for k in inverse if k not in sd]
    if missing:
        raise ValueError(f"missing tensors in the Hugging Face state dict: {_names(missing)}")
    out = {}
    for hf_name, t in sd.items():
        ours = inverse[hf_name]
        if t.shape != expected[ours]:
            raise ValueError(f"tensor {hf_name} has shape {tuple(t.shape)}, expected {tuple(expected[ours])}")
        out[ours] = t
    return out


# ---------------------------------------------------------------------------------------- folders
def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    def load(name: str) -> dict[str, torch.Tensor]:
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(f"{folder}: weight file {name} (listed in the index) is missing")
        if name.endswith(".safetensors"):
            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)

    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (folder / single).is_file():
            return load(single)
        if (folder / index).is_file():
            weight_map = json.loads((folder / index).read_text())["weight_map"]
            sd: dict[str, torch.Tensor] = {}
            for shard in dict.fromkeys(weight_map.values()):
                sd.update(load(shard))
            return sd
    raise FileNotFoundError(f"{folder}: no weights (model.safetensors, model.safetensors.index.json, "
                            "pytorch_model.bin or pytorch_model.bin.index.json)")


def load_hf_lm(folder: str | Path, *, dtype: torch.dtype | None = torch.float32) -> Llama:
    """A local HF LlamaForCausalLM / Qwen2ForCausalLM folder -> our Llama (CPU; parameters cast to
    `dtype`, None keeps the stored dtypes). Reads config.json and the weights without transformers."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no Hugging Face checkpoint folder at {folder}")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json")
    hf = json.loads(config_path.read_text())
    try:
        cfg = llama_config_from_hf(hf)
        sd = from_hf_state_dict(_read_weights(folder), cfg, tie_word_embeddings=_tied(hf))
    except ValueError as e:
        raise ValueError(f"{folder}: {e}") from None
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    with torch.device("meta"):
        model = Llama(cfg)  # no init work or memory: every parameter is replaced below
    model.load_state_dict(sd, assign=True)
    return model


def _shards(sd: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, t in sd.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += n
    return shards


def save_hf_lm(model: Llama, out_dir: str | Path, *, arch: str = "llama", tokenizer_dir: str | Path | None = None,
               dtype: torch.dtype = torch.float32, max_shard_bytes: int = 5 * 2**30, **config_kwargs) -> Path:
    """Write `model` as a HF folder that AutoModelForCausalLM.from_pretrained (and, with
    tokenizer_dir, AutoTokenizer.from_pretrained) loads: config.json (architectures, model_type,
    dtype), generation_config.json, model.safetensors (or model-0000i-of-0000n.safetensors plus
    model.safetensors.index.json past max_shard_bytes), and the tokenizer files of tokenizer_dir
    copied verbatim. config_kwargs go to the HF config (e.g. eos_token_id, pad_token_id,
    bos_token_id) and from there to the generation config. Old weight files in out_dir are removed."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    hf = hf_config(model.cfg, arch, **config_kwargs)
    hf.dtype = dtype
    sd = {k: v.to("cpu", dtype).contiguous() for k, v in to_hf_state_dict(model, arch).items()}
    tok_files = []
    if tokenizer_dir is not None:
        tokenizer_dir = Path(tokenizer_dir)
        tok_files = [tokenizer_dir / f for f in _TOKENIZER_FILES if (tokenizer_dir / f).is_file()]
        if not any(f.name in _TOKENIZER_VOCABS for f in tok_files):
            raise FileNotFoundError(f"{tokenizer_dir}: no tokenizer files (one of {', '.join(_TOKENIZER_VOCABS)})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for pattern in ("model*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin",
                    "pytorch_model.bin.index.json"):
        for stale in out.glob(pattern):
            stale.unlink()
    hf.save_pretrained(out)
    GenerationConfig.from_model_config(hf).save_pretrained(out)
    shards = _shards(sd, max_shard_bytes)
    if len(shards) == 1:
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(t.numel() * t.element_size() for t in sd.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    for f in tok_files:
        shutil.copyfile(f, out / f.name)
    return out
