"""Model-size arithmetic for the planner: parameter tables, FLOPs and saved activations of the
DiT family (common/nn/dit.py) and the Llama decoder (common/nn/llama.py), from their sizes alone.

Every function here is plain arithmetic on a ModelDesc; tests/test_plan.py checks the parameter
table against the real modules' named_parameters, the FLOPs against the models' own estimates and
the activation coefficients against SavedTensorMeter on CPU.

Conventions: N tokens per sample (the whole sequence, before context parallelism), D width, F the
MLP hidden size, H heads. A parameter's `tp` is how the model's tensor-parallel plan splits it:
0 = Shard(0) (column-wise linears, the Llama embedding and head), 1 = Shard(1) (row-wise linears),
None = the same on every TP rank (norms, row-wise biases, adaLN tables, embeddings of the DiT).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParamSpec:
    name: str                 # the model's own parameter name
    shape: tuple[int, ...]
    part: str                 # "embed" (first pipeline stage), "block", "final" (last stage)
    block: int | None = None  # block index for part == "block"
    tp: int | None = None     # tensor-parallel split dim (see the module docstring)
    # A replicated DTensor under TP (a row-wise linear's bias): DTensor's autograd reduces its
    # gradient, so it is not in the plain parameters' partial-gradient sync.
    tp_replicated: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Gemm:
    """One linear of a block: `rows` is "tokens" (N per sample) or "text" (text tokens per
    sample); the TP split is on `n` (column-wise) or `k` (row-wise)."""
    k: int
    n: int
    rows: str = "tokens"
    split: str = "n"          # "n" | "k" | "none"


@dataclass
class ModelDesc:
    kind: str                 # "dit" | "llama"
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tokens: int               # tokens per sample (sequence length)
    params: list[ParamSpec] = field(default_factory=list)
    gemms: list[Gemm] = field(default_factory=list)   # per block, forward
    causal: bool = False
    text_len: int = 0         # DiT: caption tokens (cross-attention keys)
    text_dim: int = 0
    vocab: int = 0            # Llama
    out_dim: int = 0          # DiT: values per token of the final layer
    # Saved activations per block and sample, in elements of the compute dtype (see activation_elems)
    act: dict = field(default_factory=dict)
    note: str = ""

    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def block_params(self) -> list[ParamSpec]:
        return [p for p in self.params if p.part == "block" and p.block == 0]


# --------------------------------------------------------------------------- parameter tables
def _linear(prefix: str, k: int, n: int, part: str, block=None, tp=None, bias=True, bias_tp="same"):
    out = [ParamSpec(f"{prefix}.weight", (n, k), part, block, tp)]
    if bias:
        # Column-wise linears split their bias with the output features; row-wise ones keep it whole.
        out.append(ParamSpec(f"{prefix}.bias", (n,), part, block, 0 if tp == 0 else None, tp_replicated=tp == 1))
    return out


def dit_params(hidden: int, depth: int, heads: int, mlp_hidden: int, text_dim: int, patch_in: int,
               out_dim: int, *, patch_conv: tuple[int, ...] | None = None, qk_norm: bool = True,
               pooled_text: bool = True) -> list[ParamSpec]:
    """The DiT trunk's parameters (common/nn/dit.py, dit_block.py) under its own names.
    patch_in: values per patch (p*p*C, or tp*p*p*C for video); patch_conv: (C, p, p) when the patch
    embedding is a Conv2d, None for a linear one."""
    d, hd = hidden, hidden // heads
    ps = [ParamSpec("patch_embed.proj.weight", (d, *patch_conv) if patch_conv else (d, patch_in), "embed"),
          ParamSpec("patch_embed.proj.bias", (d,), "embed")]
    ps += _linear("t_embedder.mlp.0", 256, d, "embed") + _linear("t_embedder.mlp.2", d, d, "embed")
    ps += _linear("t_block.1", d, 6 * d, "embed")
    for proj in ("caption_proj",) + (("pooled_proj",) if pooled_text else ()):
        ps += _linear(f"{proj}.fc1", text_dim, d, "embed") + _linear(f"{proj}.fc2", d, d, "embed")
    for i in range(depth):
        b = f"blocks.{i}"
        for attn in ("attn", "cross_attn"):
            for lin in ("to_q", "to_k", "to_v"):
                ps += _linear(f"{b}.{attn}.{lin}", d, d, "block", i, tp=0)
            if qk_norm:
                ps += [ParamSpec(f"{b}.{attn}.q_norm.weight", (hd,), "block", i),
                       ParamSpec(f"{b}.{attn}.k_norm.weight", (hd,), "block", i)]
            ps += _linear(f"{b}.{attn}.proj", d, d, "block", i, tp=1)
            if attn == "attn":
                ps += [ParamSpec(f"{b}.norm_cross.weight", (d,), "block", i),
                       ParamSpec(f"{b}.norm_cross.bias", (d,), "block", i)]
        ps += _linear(f"{b}.mlp.fc1", d, mlp_hidden, "block", i, tp=0)
        ps += _linear(f"{b}.mlp.fc2", mlp_hidden, d, "block", i, tp=1)
        ps.append(ParamSpec(f"{b}.scale_shift_table", (6, d), "block", i))
    ps += [ParamSpec("final.scale_shift_table", (2, d), "final")]
    ps += _linear("final.linear", d, out_dim, "final")
    return ps


def llama_params(dim: int, n_layers: int, n_heads: int, kv_heads: int, ffn: int, vocab: int, *,
                 qk_norm: bool = False, qkv_bias: bool = False, prefix: str = "") -> list[ParamSpec]:
    """common/nn/llama.py's parameters; prefix e.g. "lm." inside the vision-language model."""
    hd = dim // n_heads
    ps = [ParamSpec(f"{prefix}tok_embeddings.weight", (vocab, dim), "embed", tp=0)]
    for i in range(n_layers):
        b = f"{prefix}blocks.{i}"
        ps.append(ParamSpec(f"{b}.attention_norm.weight", (dim,), "block", i))
        ps += _linear(f"{b}.attention.to_q", dim, n_heads * hd, "block", i, tp=0, bias=qkv_bias)
        ps += _linear(f"{b}.attention.to_k", dim, kv_heads * hd, "block", i, tp=0, bias=qkv_bias)
        ps += _linear(f"{b}.attention.to_v", dim, kv_heads * hd, "block", i, tp=0, bias=qkv_bias)
        if qk_norm:
            ps += [ParamSpec(f"{b}.attention.q_norm.weight", (hd,), "block", i),
                   ParamSpec(f"{b}.attention.k_norm.weight", (hd,), "block", i)]
        ps += _linear(f"{b}.attention.proj", n_heads * hd, dim, "block", i, tp=1, bias=False)
        ps.append(ParamSpec(f"{b}.ffn_norm.weight", (dim,), "block", i))
        ps += _linear(f"{b}.mlp.w1", dim, ffn, "block", i, tp=0, bias=False)
        ps += _linear(f"{b}.mlp.w3", dim, ffn, "block", i, tp=0, bias=False)
        ps += _linear(f"{b}.mlp.w2", ffn, dim, "block", i, tp=1, bias=False)
    ps.append(ParamSpec(f"{prefix}norm.weight", (dim,), "final"))
    ps.append(ParamSpec(f"{prefix}output.weight", (vocab, dim), "final", tp=0))
    return ps


# --------------------------------------------------------------------------- descriptions
# Saved activations per block and sample (elements of the compute dtype), fitted on CPU with
# SavedTensorMeter and read off the forward code (test_plan checks them within 15%):
#   DiT block   22 N*D + 2 N*F + 3 Lt*D + 5 H*N + 6 N   (Lt: text tokens)
#   Llama block  8 N*D + 4 N*F + H*N + 2 N
# Each RMSNorm (with its RoPE) saves x_hat alone since it became one autograd node
# (common.kernels.rms_norm_rope): one N*D less per norm than the composite's input and x*r.
# Split for tensor/sequence parallelism: `stream` (residual stream, norms, modulation: sharded by
# TP only under SP), `region_in` (each TP region's input, which the region gathers in full and
# its column-wise linears keep), the rest is inside the regions (whole heads / MLP units per
# rank, divided by TP). Everything per token is divided by context parallelism.
DIT_ACT = {"nd": 22, "nf": 2, "ltd": 3, "hn": 5, "n": 6, "stream": 5, "region_in": 3}
LLAMA_ACT = {"nd": 8, "nf": 4, "ltd": 0, "hn": 1, "n": 2, "stream": 1, "region_in": 2}


def dit_desc(name: str, *, hidden: int, depth: int, heads: int, mlp_ratio: float, text_dim: int, text_len: int,
             tokens: int, patch_in: int, out_dim: int, patch_conv=None, qk_norm: bool = True,
             pooled_text: bool = True, note: str = "") -> ModelDesc:
    f = int(hidden * mlp_ratio)
    d = hidden
    gemms = [Gemm(d, d), Gemm(d, d), Gemm(d, d), Gemm(d, d, split="k"),            # self-attn q k v, out
             Gemm(d, d), Gemm(d, d, "text"), Gemm(d, d, "text"), Gemm(d, d, split="k"),  # cross q, k, v, out
             Gemm(d, f), Gemm(f, d, split="k")]                                     # MLP
    return ModelDesc("dit", name, hidden, depth, heads, heads, f, tokens,
                     dit_params(hidden, depth, heads, f, text_dim, patch_in, out_dim, patch_conv=patch_conv,
                                qk_norm=qk_norm, pooled_text=pooled_text),
                     gemms, causal=False, text_len=text_len, text_dim=text_dim, out_dim=out_dim, act=dict(DIT_ACT),
                     note=note)


def llama_desc(name: str, *, dim: int, n_layers: int, n_heads: int, kv_heads: int, ffn: int, vocab: int,
               seq_len: int, prefix: str = "", note: str = "") -> ModelDesc:
    hd = dim // n_heads
    gemms = [Gemm(dim, n_heads * hd), Gemm(dim, kv_heads * hd), Gemm(dim, kv_heads * hd),
             Gemm(n_heads * hd, dim, split="k"), Gemm(dim, ffn), Gemm(dim, ffn), Gemm(ffn, dim, split="k")]
    return ModelDesc("llama", name, dim, n_layers, n_heads, kv_heads, ffn, seq_len,
                     llama_params(dim, n_layers, n_heads, kv_heads, ffn, vocab, prefix=prefix),
                     gemms, causal=True, vocab=vocab, act=dict(LLAMA_ACT), note=note)


# Presets for --model (the project's own names where it has them: text2image's DiT "XL").
def preset(name: str) -> ModelDesc:
    if name in ("dit-xl", "dit-b", "dit-s"):
        size = {"dit-xl": (1152, 28, 16, 768), "dit-b": (768, 12, 12, 512), "dit-s": (384, 12, 6, 512)}[name]
        d, depth, heads, text_dim = size
        # text2image's presets: 32x32x4 latents (256 px, 8x VAE), patch 2 -> 256 tokens, 77 text tokens
        return dit_desc(name, hidden=d, depth=depth, heads=heads, mlp_ratio=4.0, text_dim=text_dim, text_len=77,
                        tokens=256, patch_in=16, out_dim=16, patch_conv=(4, 2, 2),
                        note="text2image preset: 256 px, 32x32x4 latents, patch 2, 77 text tokens")
    if name == "llama-7b":
        return llama_desc(name, dim=4096, n_layers=32, n_heads=32, kv_heads=32, ffn=11008, vocab=32000,
                          seq_len=4096, note="Llama-2-7B sizes, 4096-token sequences")
    raise KeyError(name)


PRESETS = ("dit-s", "dit-b", "dit-xl", "llama-7b")


# --------------------------------------------------------------------------- FLOPs
def attention_flops(desc: ModelDesc) -> float:
    """Forward FLOPs per sample of all blocks' attention scores and weighted sums (2 per MAC)."""
    n, d = desc.tokens, desc.hidden
    self_attn = 4 * n * n * d / (2 if desc.causal else 1)
    cross = 4 * n * desc.text_len * d if desc.kind == "dit" else 0
    return desc.layers * (self_attn + cross)


def gemm_flops(desc: ModelDesc) -> float:
    """Forward FLOPs per sample of every linear: the blocks' (from `gemms`) and the rest
    (embeddings, conditioning, final layer / output head)."""
    rows = {"tokens": desc.tokens, "text": desc.text_len}
    blocks = desc.layers * sum(2 * rows[g.rows] * g.k * g.n for g in desc.gemms)
    d = desc.hidden
    if desc.kind == "llama":
        return blocks + 2 * desc.tokens * d * desc.vocab
    n, lt = desc.tokens, desc.text_len
    pooled = any(p.name.startswith("pooled_proj") for p in desc.params)
    cond = 2 * (256 * d + d * d + d * 6 * d) + 2 * lt * (desc.text_dim * d + d * d)
    if pooled:
        cond += 2 * (desc.text_dim * d + d * d)
    patch_in = next(p for p in desc.params if p.name == "patch_embed.proj.weight").numel // d
    return blocks + cond + 2 * n * patch_in * d + 2 * n * d * desc.out_dim


def forward_flops(desc: ModelDesc) -> float:
    """Model FLOPs of one sample's forward; a training step is 3x (MFU counts no recompute)."""
    return gemm_flops(desc) + attention_flops(desc)


# --------------------------------------------------------------------------- activations
def block_activation_elems(desc: ModelDesc, tp: int = 1, cp: int = 1, sequence_parallel: bool = True) -> float:
    """Elements one block saves for backward per sample on one rank (no checkpointing)."""
    a, n, d, f, h = desc.act, desc.tokens / cp, desc.hidden, desc.ffn, desc.heads
    stream_div = tp if (tp > 1 and sequence_parallel) else 1
    region = (a["nd"] - a["stream"] - a["region_in"]) * n * d / tp + a["nf"] * n * f / tp + a["hn"] * h * n / tp
    text = a["ltd"] * desc.text_len * d / tp
    return a["stream"] * n * d / stream_div + a["region_in"] * n * d + region + text + a["n"] * n / stream_div


def block_input_elems(desc: ModelDesc, tp: int = 1, cp: int = 1, sequence_parallel: bool = True) -> float:
    """What a fully checkpointed block keeps per sample: its input (sequence-sharded under SP)."""
    return desc.tokens / cp * desc.hidden / (tp if (tp > 1 and sequence_parallel) else 1)


def outside_activation_elems(desc: ModelDesc, first: bool, last: bool, cp: int = 1, tp: int = 1) -> dict:
    """Per sample, elements saved outside the blocks: {"compute": compute dtype, "fp32": fp32}.
    DiT: patch input and embedding, conditioning, final layer and the MSE loss (full sequence:
    the CP gather sits before the final layer). Llama: embedding output; last stage: final norm,
    the vocab-sized logits and the fp32 log-softmax of the loss (replicated over TP)."""
    n, d = desc.tokens, desc.hidden
    comp = fp32 = 0.0
    if desc.kind == "dit":
        p = desc.out_dim
        if first:
            comp += n * p + n * d + desc.text_len * (desc.text_dim + 3 * d)
        if last:
            comp += 2 * n * d + n * p
            fp32 += n * p
    else:
        if first:
            comp += n / cp * d
        if last:
            comp += 2 * n * d + n * desc.vocab
            fp32 += 2 * n * desc.vocab
    return {"compute": comp, "fp32": fp32}
