"""Llama-style decoder-only transformer (the language tower of the vision-language pipeline).

    tokens -> embedding -> n x [x += Attn(RMSNorm(x)) (causal, GQA, 1-D RoPE);
                                x += SwiGLU(RMSNorm(x))] -> RMSNorm -> output head -> logits

Architecture only. Every projection is its own nn.Linear and head counts are inferred from
tensor widths at run time, so a tensor-parallel shard of whole heads (common.parallel.
tensor_parallel) runs this code unchanged; `attn_impl` is the context-parallel hook, as in
common.nn.attention.SelfAttention.

Packed rows (common.data.packing): tokens (R, L) hold several samples each; `cu_seqlens` (S + 1,)
int32 gives every sample's (and every row's padding tail's) offsets in the flattened R * L tokens,
and `positions` (R, L) restart at 0 per sample. Attention then runs in the kernels' varlen layout,
so no token attends across a sample boundary.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from common.kernels import apply_rope, attention, rope_frequencies

from .attention import _heads, _merge
from .mlp import SwiGLU
from .norm import RMSNorm


@dataclass
class LlamaConfig:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None     # None = n_heads (plain multi-head attention)
    vocab_size: int = 32000
    ffn_hidden: int | None = None     # None = Llama rule below
    multiple_of: int = 256            # Llama rule: round 2/3 * 4 * dim (* multiplier) up to this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    qk_norm: bool = False             # per-head RMSNorm on q and k (Qwen3 / OLMo-2 style)
    qkv_bias: bool = False            # bias on the q/k/v projections (Qwen2 style)

    def __post_init__(self):
        kv = self.kv_heads
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} not divisible by n_heads {self.n_heads}")
        if self.n_heads % kv:
            raise ValueError(f"n_heads {self.n_heads} not a multiple of n_kv_heads {kv} (GQA groups)")
        if self.head_dim % 2:
            raise ValueError(f"head dim {self.head_dim} must be even for rotate-half RoPE")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        # 2/3 of a 4x MLP keeps SwiGLU's three matrices at the parameter count of two 4x ones.
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


class LlamaAttention(nn.Module):
    """Causal grouped-query attention: Hq query heads share Hkv key/value heads (Hq % Hkv == 0)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int | None = None, *, qk_norm: bool = False,
                 eps: float = 1e-5, qkv_bias: bool = False):
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        if dim % n_heads or n_heads % n_kv_heads:
            raise ValueError(f"need dim {dim} % n_heads {n_heads} == 0 and n_heads % n_kv_heads {n_kv_heads} == 0")
        # Global counts (validation, FLOPs); forward derives the local counts from widths.
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        hd = self.head_dim
        self.to_q = nn.Linear(dim, n_heads * hd, bias=qkv_bias)
        self.to_k = nn.Linear(dim, n_kv_heads * hd, bias=qkv_bias)
        self.to_v = nn.Linear(dim, n_kv_heads * hd, bias=qkv_bias)
        self.q_norm = RMSNorm(hd, eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(hd, eps) if qk_norm else nn.Identity()
        self.proj = nn.Linear(n_heads * hd, dim, bias=False)
        self.attn_impl = None  # context parallelism plugs in a kernels.attention-compatible callable

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attn_mask: torch.Tensor | None = None, *, cu_seqlens: torch.Tensor | None = None,
                max_seqlen: int | None = None) -> torch.Tensor:
        """x (B, L, D); rope = (cos, sin) (L, head_dim), or (B, 1, L, head_dim) for per-row
        positions; attn_mask optional, combined with causal. cu_seqlens (S + 1,) int32 over the
        flattened B * L tokens: causal attention within each sequence only (packed rows);
        max_seqlen, the longest sequence, spares GPU kernels a device sync."""
        hd = self.head_dim
        q, k, v = _heads(self.to_q(x), hd), _heads(self.to_k(x), hd), _heads(self.to_v(x), hd)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cu_seqlens is not None:
            if attn_mask is not None:
                raise ValueError("pass either attn_mask or cu_seqlens (packed sequences are the mask), not both")
            if self.attn_impl is not None:
                # Context parallelism: q/k/v stay (B, H, L_local, hd); cu_seqlens describes the
                # whole (unsharded) B * L rows, which the CP attention splits into its segments.
                return self.proj(_merge(self.attn_impl(q, k, v, causal=True, cu_seqlens=cu_seqlens,
                                                       max_seqlen=max_seqlen)))
            b, l = x.shape[:2]
            flat = [t.transpose(1, 2).reshape(b * l, t.shape[1], hd) for t in (q, k, v)]  # (B*L, H, hd)
            out = attention(*flat, causal=True, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                            max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)
            return self.proj(out.reshape(b, l, -1))
        attend = self.attn_impl or attention
        # k/v keep Hkv heads: kernels.attention expands them to the query heads (GQA).
        return self.proj(_merge(attend(q, k, v, causal=True, attn_mask=attn_mask)))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = LlamaAttention(cfg.dim, cfg.n_heads, cfg.kv_heads, qk_norm=cfg.qk_norm, eps=cfg.norm_eps,
                                        qkv_bias=cfg.qkv_bias)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.dim, cfg.ffn_dim)

    # ---- tensor-parallel plan (mechanisms in common.parallel.tensor_parallel, imported lazily so
    # that importing common.nn pulls in no torch.distributed.tensor.parallel and no import cycle)
    tp_plan_name = "llama"
    tp_regions = ("attention", "mlp")

    @staticmethod
    def tp_plan(sequence_parallel: bool) -> dict:
        from torch.distributed.tensor.parallel import ColwiseParallel

        from common.parallel.tensor_parallel import region_input, rowwise_out
        sp = sequence_parallel
        # forward calls attention(x, rope, attn_mask) and mlp(x); cu_seqlens/max_seqlen go by
        # keyword, which PrepareModuleInput passes through untouched.
        return {"attention": region_input(sp, 3),
                "attention.to_q": ColwiseParallel(), "attention.to_k": ColwiseParallel(),
                "attention.to_v": ColwiseParallel(), "attention.proj": rowwise_out(sp),
                "mlp": region_input(sp),
                "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(), "mlp.w2": rowwise_out(sp)}

    def tp_check(self, tp: int, where: str) -> None:
        """ValueError unless every split dimension divides by the TP degree; `where` is e.g. "block 3"."""
        where, a = f"Llama {where}", self.attention
        dim = a.to_q.in_features
        if dim % tp:
            raise ValueError(f"{where}: dim {dim} is not divisible by tensor-parallel degree {tp}")
        if a.n_heads % tp:
            raise ValueError(f"{where}: attention heads {a.n_heads} are not divisible by tensor-parallel degree {tp}")
        if a.n_kv_heads % tp:
            raise ValueError(f"{where}: kv heads {a.n_kv_heads} are not divisible by tensor-parallel "
                             f"degree {tp} (each rank must hold whole kv heads of its query groups)")
        h = self.mlp.w1.out_features
        if h % tp:
            raise ValueError(f"{where}: SwiGLU hidden size {h} is not divisible by tensor-parallel degree {tp}")

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attn_mask: torch.Tensor | None = None, *, cu_seqlens: torch.Tensor | None = None,
                max_seqlen: int | None = None) -> torch.Tensor:
        # Three positional arguments: the tensor-parallel plan's PrepareModuleInput counts them.
        x = x + self.attention(self.attention_norm(x), rope, attn_mask, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        return x + self.mlp(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Unit-variance embeddings; N(0, 0.02) projections with the residual-branch outputs
        # (attention proj, SwiGLU w2) scaled by 1/sqrt(2 * n_layers) so the residual stream's
        # variance does not grow with depth (GPT-2 / Megatron); head std dim^-0.5 gives unit-scale
        # logits from the unit-RMS normalised features. Truncation at 3 std avoids rare outliers.
        cfg = self.cfg
        nn.init.normal_(self.tok_embeddings.weight)
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        for block in self.blocks:
            for lin in (block.attention.to_q, block.attention.to_k, block.attention.to_v, block.mlp.w1, block.mlp.w3):
                nn.init.trunc_normal_(lin.weight, std=0.02, a=-0.06, b=0.06)
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)
            for lin in (block.attention.proj, block.mlp.w2):
                nn.init.trunc_normal_(lin.weight, std=out_std, a=-3 * out_std, b=3 * out_std)
            for norm in block.modules():
                if isinstance(norm, RMSNorm):
                    nn.init.ones_(norm.weight)
        nn.init.ones_(self.norm.weight)
        std = cfg.dim ** -0.5
        nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)

    # ---- model-level tensor-parallel plan (the blocks bring their own, LlamaBlock.tp_plan)
    @staticmethod
    def tp_model_plan(loss_parallel: bool = False) -> dict:
        """Embedding split by vocabulary rows (output all-reduced, replicated so that callers may
        splice other embeddings in before the blocks); head split by vocabulary columns. Logits
        are all-gathered to a replicated (B, L, V) plain tensor by default, so any loss works
        unchanged; with loss_parallel they stay vocab-sharded DTensors and the loss must run
        inside torch.distributed.tensor.parallel.loss_parallel()."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        head = (ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) if loss_parallel
                else ColwiseParallel(output_layouts=Replicate()))
        return {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                "output": head}

    def tp_model_check(self, tp: int) -> None:
        v = self.cfg.vocab_size
        if v % tp:
            raise ValueError(f"Llama: vocab size {v} is not divisible by tensor-parallel degree {tp} "
                             "(embedding and output head are split by vocabulary)")

    def rope(self, seq_len: int | None = None, positions: torch.Tensor | None = None,
             device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) tables for positions (L,) (default 0..seq_len-1), each (L, head_dim); for
        per-row positions (B, L) (packed rows), each (B, 1, L, head_dim), broadcasting over heads."""
        if positions is None:
            positions = torch.arange(seq_len, device=device)
        if positions.dim() == 2:
            cos, sin = rope_frequencies(positions.reshape(-1), (self.cfg.head_dim,), self.cfg.rope_theta)
            shape = (*positions.shape[:1], 1, positions.shape[1], -1)
            return cos.view(shape), sin.view(shape)
        return rope_frequencies(positions, (self.cfg.head_dim,), self.cfg.rope_theta)

    def hidden_states(self, tokens: torch.Tensor | None = None, *, inputs_embeds: torch.Tensor | None = None,
                      positions: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                      cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None) -> torch.Tensor:
        """Final-normed features (B, L, dim) before the output head. Pass `tokens` (B, L) or
        `inputs_embeds` (B, L, dim) (e.g. image features spliced between text embeddings).
        positions: (L,) shared by the rows or (B, L) per row. Packed rows: cu_seqlens (S + 1,)
        int32 covering all B * L tokens, with positions (B, L) restarting per sequence and
        max_seqlen the longest sequence (computed from cu_seqlens, one device sync, when None)."""
        if (tokens is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of tokens or inputs_embeds")
        h = self.tok_embeddings(tokens) if inputs_embeds is None else inputs_embeds
        b, seq_len = h.shape[:2]
        if positions is not None and positions.dim() == 2 and tuple(positions.shape) != (b, seq_len):
            raise ValueError(f"positions {tuple(positions.shape)} do not match the batch ({b}, {seq_len})")
        if cu_seqlens is not None:
            if positions is None or positions.dim() != 2:
                # Positions running on across a row's samples would silently shift every sample
                # after the first; pass them explicitly (common.data.packing builds them).
                raise ValueError("packed rows (cu_seqlens) need per-row positions (B, L) restarting per sequence")
            if max_seqlen is None:
                cu = cu_seqlens.tolist()
                if not cu or cu[0] != 0 or cu[-1] != b * seq_len or any(x > y for x, y in zip(cu, cu[1:])):
                    raise ValueError(f"cu_seqlens must rise from 0 to the {b} x {seq_len} = {b * seq_len} "
                                     f"tokens of the batch; got {len(cu)} offsets ending at {cu[-1] if cu else None}")
                max_seqlen = max((y - x for x, y in zip(cu, cu[1:])), default=0)
            # Positions restart per sequence: the limit is on the longest sequence, not the row.
            seq_len = max_seqlen
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {self.cfg.max_seq_len}")
        rope = self.rope(h.shape[1], positions, h.device)
        for block in self.blocks:
            h = block(h, rope, attn_mask, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        return self.norm(h)

    def forward(self, tokens: torch.Tensor | None = None, *, inputs_embeds: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None) -> torch.Tensor:
        """-> logits (B, L, vocab_size)."""
        return self.output(self.hidden_states(tokens, inputs_embeds=inputs_embeds, positions=positions,
                                              attn_mask=attn_mask, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen))
