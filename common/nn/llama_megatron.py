"""Weight conversion between our Llama (common/nn/llama.py) and megatron-core's GPTModel.

megatron-core is optional: the converters are plain tensor code (no import of megatron), and only
`build_megatron_gpt` / `load_megatron_state_dict` import it, lazily. Key names and layouts follow
megatron-core's GPTModel (megatron/core/models/gpt/gpt_model.py, gpt_layer_specs.py,
transformer/attention.py SelfAttention.get_query_key_value_tensors, transformer/mlp.py glu).

Names (per layer i; ours -> megatron; the two layer specs differ only in where the norms live):

    tok_embeddings.weight            embedding.word_embeddings.weight
    blocks.i.attention_norm.weight   te:    decoder.layers.i.self_attention.linear_qkv.layer_norm_weight
                                     local: decoder.layers.i.input_layernorm.weight
    blocks.i.attention.to_{q,k,v}    decoder.layers.i.self_attention.linear_qkv.weight (.bias: qkv_bias)
    blocks.i.attention.{q,k}_norm    decoder.layers.i.self_attention.{q,k}_layernorm.weight (qk_norm)
    blocks.i.attention.proj.weight   decoder.layers.i.self_attention.linear_proj.weight
    blocks.i.ffn_norm.weight         te:    decoder.layers.i.mlp.linear_fc1.layer_norm_weight
                                     local: decoder.layers.i.pre_mlp_layernorm.weight
    blocks.i.mlp.{w1,w3}.weight      decoder.layers.i.mlp.linear_fc1.weight
    blocks.i.mlp.w2.weight           decoder.layers.i.mlp.linear_fc2.weight
    norm.weight                      decoder.final_layernorm.weight
    output.weight                    output_layer.weight

"te" is get_gpt_layer_with_transformer_engine_spec (the norms fused into TE's
LayerNormColumnParallelLinear); "local" is get_gpt_layer_local_spec (separate norm modules).
TE modules also save `<module>._extra_state` entries (fp8 metadata); they carry no weights, are
skipped on import and not produced on export (load with `load_megatron_state_dict`).

Fused QKV (`linear_qkv.weight`, rows = (Hq + 2 Hkv) * hd, cols = dim): grouped by kv head. With
G = Hkv groups and r = Hq / G query heads per group, the rows are G blocks of (r + 2) * hd:

    block g = [ q heads g*r .. g*r + r - 1 (hd rows each) | k head g (hd rows) | v head g (hd rows) ]

so k head g starts at row g * (r + 2) * hd + r * hd. Megatron views the projection output as
(..., G, (r + 2) * hd) and splits the last dim into [r * hd, hd, hd]. The bias follows the same rows.

SwiGLU (`linear_fc1.weight`, rows = 2 * ffn): [gate (our w1, the silu branch); up (our w3)]:
megatron's glu chunks fc1's output in two halves and computes silu(first) * second.

No permutation of q/k rows: megatron's RoPE is rotate-half by default (rotary_interleaved=False),
as is common.kernels.rope, with the same inverse frequencies theta^(-2j/hd).

These are the full (tensor-parallel size 1) tensors. Under tensor parallelism of size T,
`shard_megatron_state_dict` gives rank t's local tensors: linear_qkv rows split into T contiguous
chunks of G / T whole groups; fc1's gate and up halves split separately, rank t holding
[gate_t; up_t]; linear_proj and fc2 split by input columns; embedding and output head by
vocabulary rows; norms replicated.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from .llama import Llama, LlamaConfig

SPECS = ("te", "local")
_EXTRA = "_extra_state"


def _check_spec(spec: str) -> str:
    if spec not in SPECS:
        raise ValueError(f"unknown megatron layer spec {spec!r}: expected one of {SPECS}")
    return spec


def _norm_names(spec: str) -> tuple[str, str]:
    if _check_spec(spec) == "te":
        return "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


# ------------------------------------------------------------------------------------ QKV layout
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """q (Hq*hd, ...), k and v (Hkv*hd, ...) -> megatron's grouped (G*(r+2)*hd, ...) layout."""
    g, r = n_kv_heads, n_heads // n_kv_heads
    hd = k.shape[0] // g
    rest = q.shape[1:]
    return torch.cat([q.reshape(g, r * hd, *rest), k.reshape(g, hd, *rest), v.reshape(g, hd, *rest)],
                     dim=1).reshape(g * (r + 2) * hd, *rest)


def split_qkv(qkv: torch.Tensor, n_heads: int, n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of fuse_qkv: megatron's grouped rows -> (q, k, v), contiguous."""
    g, r = n_kv_heads, n_heads // n_kv_heads
    if qkv.shape[0] % (g * (r + 2)):
        raise ValueError(f"fused qkv has {qkv.shape[0]} rows, not a multiple of {g * (r + 2)} "
                         f"({n_heads} query heads in {n_kv_heads} groups)")
    hd = qkv.shape[0] // (g * (r + 2))
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(g, (r + 2) * hd, *rest).split([r * hd, hd, hd], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))


# ------------------------------------------------------------------------------------ converters
def to_megatron_state_dict(model_or_sd: Llama | Mapping[str, torch.Tensor], cfg: LlamaConfig | None = None,
                           spec: str = "te") -> dict[str, torch.Tensor]:
    """Our model (or its unsharded state dict, with cfg) -> GPTModel state dict for `spec`."""
    if isinstance(model_or_sd, Llama):
        cfg = cfg or model_or_sd.cfg
        sd = model_or_sd.state_dict()
    else:
        sd = model_or_sd
    if cfg is None:
        raise ValueError("to_megatron_state_dict needs cfg when given a state dict")
    attn_norm, mlp_norm = _norm_names(spec)
    sd = {k: v.detach() for k, v in sd.items()}
    out = {"embedding.word_embeddings.weight": sd.pop("tok_embeddings.weight"),
           "decoder.final_layernorm.weight": sd.pop("norm.weight"),
           "output_layer.weight": sd.pop("output.weight")}
    for i in range(cfg.n_layers):
        ours, meg = f"blocks.{i}.", f"decoder.layers.{i}."
        a = ours + "attention."
        out[meg + attn_norm] = sd.pop(ours + "attention_norm.weight")
        out[meg + "self_attention.linear_qkv.weight"] = fuse_qkv(
            *(sd.pop(f"{a}to_{x}.weight") for x in "qkv"), cfg.n_heads, cfg.kv_heads)
        if cfg.qkv_bias:
            out[meg + "self_attention.linear_qkv.bias"] = fuse_qkv(
                *(sd.pop(f"{a}to_{x}.bias") for x in "qkv"), cfg.n_heads, cfg.kv_heads)
        if cfg.qk_norm:
            out[meg + "self_attention.q_layernorm.weight"] = sd.pop(a + "q_norm.weight")
            out[meg + "self_attention.k_layernorm.weight"] = sd.pop(a + "k_norm.weight")
        out[meg + "self_attention.linear_proj.weight"] = sd.pop(a + "proj.weight")
        out[meg + mlp_norm] = sd.pop(ours + "ffn_norm.weight")
        out[meg + "mlp.linear_fc1.weight"] = torch.cat([sd.pop(ours + "mlp.w1.weight"),
                                                        sd.pop(ours + "mlp.w3.weight")])
        out[meg + "mlp.linear_fc2.weight"] = sd.pop(ours + "mlp.w2.weight")
    if sd:
        raise ValueError(f"tensors with no megatron name: {sorted(sd)[:8]}")
    return out


def detect_spec(sd: Mapping[str, torch.Tensor]) -> str:
    """"te" when the norms are fused into the linears (layer_norm_weight keys), else "local"."""
    return "te" if any(k.endswith("linear_qkv.layer_norm_weight") for k in sd) else "local"


def from_megatron_state_dict(sd: Mapping[str, torch.Tensor], cfg: LlamaConfig, spec: str = "te", *,
                             padded_vocab: bool = False) -> dict[str, torch.Tensor]:
    """GPTModel state dict (tensor-parallel size 1, e.g. `merge_megatron_state_dicts` of the
    shards) -> ours, for Llama(cfg).load_state_dict. spec "auto" detects it from the keys.
    `_extra_state` entries are skipped; padded_vocab drops the vocabulary rows megatron-training
    padded beyond cfg.vocab_size. ValueError naming missing or unexpected keys."""
    if spec == "auto":
        spec = detect_spec(sd)
    attn_norm, mlp_norm = _norm_names(spec)
    sd = {k: v for k, v in sd.items() if not k.endswith(_EXTRA)}
    taken: set[str] = set()

    def pop(key: str) -> torch.Tensor:
        if key not in sd:
            raise ValueError(f"missing key {key!r} in the megatron state dict (spec {spec!r})")
        taken.add(key)
        return sd[key]

    def vocab(key: str) -> torch.Tensor:
        t = pop(key)
        if padded_vocab and t.shape[0] > cfg.vocab_size:
            t = t[:cfg.vocab_size].contiguous()
        if t.shape[0] != cfg.vocab_size:
            raise ValueError(f"{key} has {t.shape[0]} vocabulary rows, config says {cfg.vocab_size}"
                             + ("" if padded_vocab else " (padded vocabulary: pass padded_vocab=True)"))
        return t

    out = {"tok_embeddings.weight": vocab("embedding.word_embeddings.weight"),
           "norm.weight": pop("decoder.final_layernorm.weight"),
           "output.weight": vocab("output_layer.weight")}
    for i in range(cfg.n_layers):
        ours, meg = f"blocks.{i}.", f"decoder.layers.{i}."
        a, s = ours + "attention.", meg + "self_attention."
        out[ours + "attention_norm.weight"] = pop(meg + attn_norm)
        q, k, v = split_qkv(pop(s + "linear_qkv.weight"), cfg.n_heads, cfg.kv_heads)
        out.update({a + "to_q.weight": q, a + "to_k.weight": k, a + "to_v.weight": v})
        if cfg.qkv_bias:
            q, k, v = split_qkv(pop(s + "linear_qkv.bias"), cfg.n_heads, cfg.kv_heads)
            out.update({a + "to_q.bias": q, a + "to_k.bias": k, a + "to_v.bias": v})
        if cfg.qk_norm:
            out[a + "q_norm.weight"] = pop(s + "q_layernorm.weight")
            out[a + "k_norm.weight"] = pop(s + "k_layernorm.weight")
        out[a + "proj.weight"] = pop(s + "linear_proj.weight")
        out[ours + "ffn_norm.weight"] = pop(meg + mlp_norm)
        fc1 = pop(meg + "mlp.linear_fc1.weight")
        if fc1.shape[0] != 2 * cfg.ffn_dim:
            raise ValueError(f"{meg}mlp.linear_fc1.weight has {fc1.shape[0]} rows, expected 2 x ffn {cfg.ffn_dim}")
        out[ours + "mlp.w1.weight"], out[ours + "mlp.w3.weight"] = (t.contiguous() for t in fc1.chunk(2))
        out[ours + "mlp.w2.weight"] = pop(meg + "mlp.linear_fc2.weight")
    unexpected = sorted(set(sd) - taken)
    if unexpected:
        raise ValueError(f"unexpected keys in the megatron state dict (spec {spec!r}): {unexpected[:8]}"
                         + (f" (+{len(unexpected) - 8} more)" if len(unexpected) > 8 else ""))
    return out


# ------------------------------------------------------------------------------- tensor parallel
def _tp_rule(key: str) -> str:
    """How a GPTModel tensor is split under tensor parallelism: rows | cols | fc1 | replicated."""
    if key.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight")) or key == "output_layer.weight":
        return "rows"
    if key.endswith("linear_fc1.weight"):
        return "fc1"
    if key.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "cols"
    return "replicated"


def shard_megatron_state_dict(sd: Mapping[str, torch.Tensor], cfg: LlamaConfig, tp_size: int,
                              tp_rank: int) -> dict[str, torch.Tensor]:
    """Full GPTModel state dict -> tensor-parallel rank tp_rank's local tensors (of tp_size)."""
    if cfg.kv_heads % tp_size or cfg.vocab_size % tp_size or cfg.ffn_dim % tp_size:
        raise ValueError(f"kv heads {cfg.kv_heads}, vocab {cfg.vocab_size} and ffn {cfg.ffn_dim} must all be "
                         f"divisible by the tensor-parallel size {tp_size}")
    out = {}
    for key, t in sd.items():
        rule = _tp_rule(key)
        if rule == "rows":
            t = t.chunk(tp_size, dim=0)[tp_rank]
        elif rule == "cols":
            t = t.chunk(tp_size, dim=1)[tp_rank]
        elif rule == "fc1":
            gate, up = t.chunk(2, dim=0)
            t = torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])
        out[key] = t.contiguous()
    return out


def merge_megatron_state_dicts(shards: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Inverse of shard_megatron_state_dict: the tensor-parallel ranks' state dicts, in rank
    order -> the full state dict (replicated tensors from rank 0; `_extra_state` dropped)."""
    out = {}
    for key, t0 in shards[0].items():
        if key.endswith(_EXTRA):
            continue
        parts = [s[key] for s in shards]
        rule = _tp_rule(key)
        if rule == "rows":
            out[key] = torch.cat(parts, dim=0)
        elif rule == "cols":
            out[key] = torch.cat(parts, dim=1)
        elif rule == "fc1":
            halves = [p.chunk(2, dim=0) for p in parts]
            out[key] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            out[key] = t0
    return out


# --------------------------------------------------------------------------- megatron-core model
def _require_megatron():
    if not torch.cuda.is_available():
        raise RuntimeError("build_megatron_gpt needs CUDA (megatron-core's GPTModel runs on GPUs only)")
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise RuntimeError("build_megatron_gpt needs megatron-core (pip install megatron-core; "
                           f"Transformer Engine for spec='te'): {e}") from None


def megatron_transformer_config(cfg: LlamaConfig, *, tp_size: int = 1, dtype: torch.dtype = torch.bfloat16,
                                **overrides):
    """megatron-core TransformerConfig matching cfg: RMSNorm, SwiGLU, GQA, no linear biases
    (q/k/v bias when cfg.qkv_bias), RoPE handled by GPTModel, no dropout."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=cfg.n_layers, hidden_size=cfg.dim, num_attention_heads=cfg.n_heads,
              num_query_groups=cfg.kv_heads, kv_channels=cfg.head_dim, ffn_hidden_size=cfg.ffn_dim,
              normalization="RMSNorm", layernorm_epsilon=cfg.norm_eps, gated_linear_unit=True,
              activation_func=F.silu, add_bias_linear=False, add_qkv_bias=cfg.qkv_bias,
              qk_layernorm=cfg.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
              rotary_interleaved=False, apply_rope_fusion=False, bias_activation_fusion=False,
              masked_softmax_fusion=False, persist_layer_norm=False, tensor_model_parallel_size=tp_size,
              params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_megatron_gpt(cfg: LlamaConfig, *, spec: str = "te", tp_group=None, dtype: torch.dtype = torch.bfloat16,
                       parallel_output: bool = True, seed: int = 0, **config_overrides):
    """megatron-core GPTModel with our architecture (untied head, RoPE with cfg.rope_theta), on
    the current CUDA device. Megatron's model-parallel state is initialised when it is not yet:
    torch.distributed (a one-process NCCL group on an in-memory store when not initialised) and
    initialize_model_parallel(tensor_model_parallel_size = tp_group's size, default 1). With
    tp_group given and megatron already initialised, the sizes must agree. RuntimeError when
    megatron-core or CUDA is missing."""
    _check_spec(spec)
    _require_megatron()
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    if not dist.is_initialized():
        if tp_size != 1:
            raise RuntimeError("tp_group given but torch.distributed is not initialised")
        dist.init_process_group("nccl", store=dist.HashStore(), world_size=1, rank=0)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    megatron_tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp_group is not None and megatron_tp != tp_size:
        raise RuntimeError(f"megatron's tensor-parallel size is {megatron_tp}, tp_group has {tp_size} ranks")
    model_parallel_cuda_manual_seed(seed)
    tcfg = megatron_transformer_config(cfg, tp_size=megatron_tp, dtype=dtype, **config_overrides)
    if spec == "te":
        layer_spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=cfg.qk_norm)
    else:
        try:
            layer_spec = get_gpt_layer_local_spec(qk_layernorm=cfg.qk_norm, normalization="RMSNorm")
        except TypeError:  # older megatron-core: no normalization argument
            layer_spec = get_gpt_layer_local_spec(qk_layernorm=cfg.qk_norm)
    model = GPTModel(config=tcfg, transformer_layer_spec=layer_spec, vocab_size=cfg.vocab_size,
                     max_sequence_length=cfg.max_seq_len, pre_process=True, post_process=True,
                     parallel_output=parallel_output, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope", rotary_percent=1.0, rotary_base=cfg.rope_theta)
    return model.to(device=torch.cuda.current_device())


def load_megatron_state_dict(gpt_model, model_or_sd: Llama | Mapping[str, torch.Tensor],
                             cfg: LlamaConfig | None = None, spec: str = "te") -> None:
    """Load our weights into a GPTModel built by build_megatron_gpt (this rank's tensor-parallel
    shard). Only TE's `_extra_state` entries may stay unset."""
    from megatron.core import parallel_state

    cfg = cfg or getattr(model_or_sd, "cfg", None)
    full = to_megatron_state_dict(model_or_sd, cfg, spec)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:
        full = shard_megatron_state_dict(full, cfg, tp, parallel_state.get_tensor_model_parallel_rank())
    result = gpt_model.load_state_dict(full, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith(_EXTRA)]
    if missing or result.unexpected_keys:
        raise ValueError(f"GPTModel state dict mismatch: missing {missing[:8]}, "
                         f"unexpected {result.unexpected_keys[:8]}")
