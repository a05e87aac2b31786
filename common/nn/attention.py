"""Self- and cross-attention layers with per-head QK-norm (RMSNorm).

QK-norm bounds attention logits, which is what keeps large DiTs stable in bf16 (SD3, ViT-22B).
All attention math goes through common.kernels.attention.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from common.kernels import apply_rope, attention, rms_norm_rope

from .norm import RMSNorm


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    # The head count comes from the width, so a tensor-parallel shard (a slice of whole heads) works.
    b, l, _ = x.shape
    return x.view(b, l, -1, head_dim).transpose(1, 2)  # (B, H, L, Dh)


def _norm_rope(norm: nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """QK-norm then RoPE, as one fused op when the norm is our RMSNorm (common.kernels.rms_norm_rope)."""
    if type(norm) is RMSNorm:
        return rms_norm_rope(x, norm.weight, norm.eps, rope)
    x = norm(x)
    return x if rope is None else apply_rope(x, *rope)


def _merge(x: torch.Tensor) -> torch.Tensor:
    b, h, l, d = x.shape
    return x.transpose(1, 2).reshape(b, l, h * d)


class SelfAttention(nn.Module):
    """q/k/v projections -> QK-norm -> optional RoPE -> attention -> out proj.

    q, k and v are separate linears (not one fused qkv) so that a column-wise tensor-parallel
    shard holds whole heads of each. `attn_impl` is where context parallelism plugs in a
    sequence-sharded attention with kernels.attention's signature; None = kernels.attention.
    """

    def __init__(self, dim: int, heads: int, *, qk_norm: bool = True, bias: bool = True, eps: float = 1e-6):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} not divisible by heads {heads}")
        self.heads, self.head_dim = heads, dim // heads
        self.to_q = nn.Linear(dim, dim, bias=bias)
        self.to_k = nn.Linear(dim, dim, bias=bias)
        self.to_v = nn.Linear(dim, dim, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=bias)
        self.attn_impl = None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                attn_mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        d = self.head_dim
        q, k, v = _heads(self.to_q(x), d), _heads(self.to_k(x), d), _heads(self.to_v(x), d)
        q, k = _norm_rope(self.q_norm, q, rope), _norm_rope(self.k_norm, k, rope)
        attend = self.attn_impl or attention
        return self.proj(_merge(attend(q, k, v, causal=causal, attn_mask=attn_mask)))


def _all_true_on_cpu(flags: torch.Tensor) -> bool:
    return flags.device.type == "cpu" and not torch.compiler.is_compiling() and bool(flags.all())


# ATen's CPU flash-attention kernel runs key blocks whose length is a multiple of 16 several times
# faster than a ragged tail: fp32 forward + backward at the demo's shapes (32 x 4 heads x 64
# queries, head dim 32) takes 6.6 ms for 9 keys and 3.1 ms for 16; at DiT-S's (6 x 256, dim 64)
# 51 ms for 9 keys and 39 ms for 16, 95 ms for CLIP's 77 and 78 ms for 80
# (`python bench/cpu_attention_keys.py`).
CPU_KEY_MULTIPLE = 16


def trim_key_padding(context: torch.Tensor, context_mask: torch.Tensor | None):
    """Fit the key columns to what the batch uses (eager, plain CPU tensors): drop the trailing
    columns that no sample uses, then round the count up to a multiple of CPU_KEY_MULTIPLE,
    padding with masked zero keys where that passes the context's length.

    Captions are padded to the text tower's context length (32 in the demo, 77 for CLIP, 120+
    for T5) while most are far shorter; masked keys get zero attention weight and so zero
    gradient, so dropping or adding them changes nothing but rounding, and dropping saves their
    K/V projections, k-norm and attention columns. CPU only: on an accelerator the length would
    be a host sync per block, and under compile a data-dependent shape. CrossAttention calls it
    within the block, so stage I/O shapes (pipeline parallelism) stay fixed; DiTTrunk.run_blocks
    calls it once before its blocks, so per-block compiled code gets the trimmed keys too. The
    trimmed length is marked dynamic for dynamo, so the few lengths a run sees share one graph
    instead of recompiling a block each."""
    if (context_mask is None or type(context) is not torch.Tensor or type(context_mask) is not torch.Tensor
            or context_mask.device.type != "cpu" or torch.compiler.is_compiling()):
        return context, context_mask
    used = context_mask.any(0).nonzero()
    n = int(used[-1]) + 1 if len(used) else 1
    n = -(-n // CPU_KEY_MULTIPLE) * CPU_KEY_MULTIPLE
    length = context_mask.shape[-1]
    if n == length:
        return context, context_mask
    if n > length:
        context, context_mask = F.pad(context, (0, 0, 0, n - length)), F.pad(context_mask, (0, n - length), value=False)
    else:  # contiguous: to_k and to_v would each copy a strided slice, and a compiled block
        # would recompile when a padded (contiguous) mask follows a sliced one
        context, context_mask = context[:, :n].contiguous(), context_mask[:, :n].contiguous()
    if "torch._dynamo" in sys.modules:  # never imported: nothing is compiled
        torch._dynamo.maybe_mark_dynamic(context, 1)
        torch._dynamo.maybe_mark_dynamic(context_mask, 1)
    return context, context_mask


class CrossAttention(nn.Module):
    """Queries from x, keys/values from context (e.g. text tokens) with a key padding mask."""

    def __init__(self, dim: int, heads: int, context_dim: int | None = None, *, qk_norm: bool = True,
                 bias: bool = True, eps: float = 1e-6):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} not divisible by heads {heads}")
        self.heads, self.head_dim = heads, dim // heads
        self.to_q = nn.Linear(dim, dim, bias=bias)
        self.to_k = nn.Linear(context_dim or dim, dim, bias=bias)
        self.to_v = nn.Linear(context_dim or dim, dim, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: torch.Tensor, context: torch.Tensor,
                context_mask: torch.Tensor | None = None) -> torch.Tensor:
        """context_mask (B, Lk) bool, True = real token. A sample with no valid token gets a
        zero output instead of the NaN a fully masked softmax would give."""
        d = self.head_dim
        if context_mask is not None:
            context_mask = context_mask.bool()
        context, context_mask = trim_key_padding(context, context_mask)
        q = self.q_norm(_heads(self.to_q(x), d))
        k, v = self.k_norm(_heads(self.to_k(context), d)), _heads(self.to_v(context), d)
        mask, any_valid = None, None
        if context_mask is not None:
            any_valid = context_mask.any(-1)  # (B,)
            mask = (context_mask | ~any_valid[:, None])[:, None, None, :]  # (B, 1, 1, Lk)
        out = _merge(attention(q, k, v, attn_mask=mask))
        if any_valid is not None and not _all_true_on_cpu(any_valid):
            # Unconditional under compile or on an accelerator (no branch on a tensor's value, no
            # host sync): keeps the block one compiled graph. Eager on CPU the check is free and
            # spares a full-size multiply (and two in backward) when every sample has a token.
            out = out * any_valid[:, None, None].to(out.dtype)
        return self.proj(out)
