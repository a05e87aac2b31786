"""DiT block with adaLN-single conditioning (PixArt-alpha) and its final layer.

adaLN-single: the timestep embedding is mapped once per model to a global vector t0 (B, 6D);
each block adds its own learned scale_shift_table (6, D). This replaces DiT's per-block adaLN
MLP (about 27% of DiT-XL's parameters) at no quality cost.

Block: x += gate_msa * SelfAttn(adaLN(x))   (QK-norm, 2-D RoPE)
       x += CrossAttn(LN(x), text)           (key padding mask)
       x += gate_mlp * MLP(adaLN(x))
Init makes every block the identity: the gate rows of t0 + table start at 0, and the
cross-attention output projection starts at 0 (PixArt) since cross-attn has no adaLN gate
among the 6 vectors. Gradients still reach every parameter after the first update.
"""
from __future__ import annotations

import torch
from torch import nn

from common.kernels import mul_add, norm_modulate

from .attention import CrossAttention, SelfAttention
from .mlp import MLP
from .norm import LayerNorm


def _xavier_linears(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


class DiTBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp_ratio: float = 4.0, context_dim: int | None = None,
                 *, qk_norm: bool = True, eps: float = 1e-6):
        super().__init__()
        self.hidden, self.eps = hidden, eps
        self.attn = SelfAttention(hidden, heads, qk_norm=qk_norm, eps=eps)
        self.norm_cross = LayerNorm(hidden, eps)
        self.cross_attn = CrossAttention(hidden, heads, context_dim, qk_norm=qk_norm, eps=eps)
        self.mlp = MLP(hidden, int(hidden * mlp_ratio))
        # rows: shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp
        self.scale_shift_table = nn.Parameter(torch.zeros(6, hidden))
        self.reset_parameters()

    # ---- tensor-parallel plan (mechanisms in common.parallel.tensor_parallel, imported lazily so
    # that importing common.nn pulls in no torch.distributed.tensor.parallel and no import cycle)
    tp_plan_name = "dit"
    tp_regions = ("attn", "cross_attn", "mlp")
    # adaLN-single: t0 (B, 6D) is computed once per model from replicated inputs and each block's
    # scale_shift_table stays a plain replicated parameter, so the modulation is bitwise the same
    # on every rank. Under SP it is applied to a token shard, so each block's dL/dt0 is partial:
    # t0 goes through copy_to_tp_region (identity forward, all-reduce backward; one B x 6D
    # all-reduce per block), keeping the timestep MLP's gradient exact. The tables themselves are
    # in the partial-grad sync.
    tp_sp_replicated_args = ((1, "t0"),)

    @staticmethod
    def tp_plan(sequence_parallel: bool) -> dict:
        from torch.distributed.tensor.parallel import ColwiseParallel

        from common.parallel.tensor_parallel import region_input, rowwise_out
        sp = sequence_parallel
        plan = {"attn": region_input(sp),
                # forward calls cross_attn(x, context, context_mask): context is replicated.
                "cross_attn": region_input(sp, 3, replicated_extra=(1,)),
                "mlp": region_input(sp),
                "mlp.fc1": ColwiseParallel(), "mlp.fc2": rowwise_out(sp)}
        for attn in ("attn", "cross_attn"):
            plan.update({f"{attn}.to_q": ColwiseParallel(), f"{attn}.to_k": ColwiseParallel(),
                         f"{attn}.to_v": ColwiseParallel(), f"{attn}.proj": rowwise_out(sp)})
        return plan

    def tp_check(self, tp: int, where: str) -> None:
        """ValueError unless every split dimension divides by the TP degree; `where` is e.g. "block 3"."""
        where = f"DiT {where}"
        if self.hidden % tp:
            raise ValueError(f"{where}: hidden size {self.hidden} is not divisible by tensor-parallel degree {tp}")
        for name, attn in (("self-attention", self.attn), ("cross-attention", self.cross_attn)):
            if attn.heads % tp:
                raise ValueError(f"{where}: {name} heads {attn.heads} are not divisible by "
                                 f"tensor-parallel degree {tp}")
        h = self.mlp.fc1.out_features
        if h % tp:
            raise ValueError(f"{where}: MLP hidden size {h} is not divisible by tensor-parallel degree {tp}")

    def reset_parameters(self) -> None:
        _xavier_linears(self)
        nn.init.zeros_(self.scale_shift_table)
        nn.init.zeros_(self.cross_attn.proj.weight)
        nn.init.zeros_(self.cross_attn.proj.bias)

    def forward(self, x: torch.Tensor, t0: torch.Tensor, context: torch.Tensor,
                context_mask: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x (B, N, D); t0 (B, 6D); context (B, L, Dc); context_mask (B, L) bool True = valid."""
        mod = self.scale_shift_table[None] + t0.view(x.shape[0], 6, self.hidden)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod.unbind(1)
        h = norm_modulate(x, shift_msa, scale_msa, self.eps)
        x = mul_add(x, gate_msa[:, None], self.attn(h, rope=rope))  # x + gate * attn, one op
        x = x + self.cross_attn(self.norm_cross(x), context, context_mask)
        h = norm_modulate(x, shift_mlp, scale_mlp, self.eps)
        return mul_add(x, gate_mlp[:, None], self.mlp(h))


class FinalLayer(nn.Module):
    """adaLN (table (2, D) + timestep embedding, PixArt's T2IFinalLayer) -> Linear to patch values.
    The linear starts at zero so the untrained model predicts 0 (DiT practice)."""

    def __init__(self, hidden: int, out_dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.scale_shift_table = nn.Parameter(torch.zeros(2, hidden))
        self.linear = nn.Linear(hidden, out_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.scale_shift_table)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        shift, scale = (self.scale_shift_table[None] + temb[:, None]).unbind(1)
        return self.linear(norm_modulate(x, shift, scale, self.eps))


def reset_dit_parameters(model: nn.Module) -> None:
    """DiT-family init (image and video DiT): xavier patch embed (as a linear), N(0, 0.02)
    timestep MLP and caption projections, zero adaLN-single output (with zero gates every block
    starts as the identity), each block's and the final layer's own init (zero final linear)."""
    w = model.patch_embed.proj.weight
    nn.init.xavier_uniform_(w.view(w.shape[0], -1))
    nn.init.zeros_(model.patch_embed.proj.bias)
    for m in model.t_embedder.mlp:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)
    projections = [model.caption_proj] + ([model.pooled_proj] if model.pooled_proj is not None else [])
    for m in (lin for proj in projections for lin in (proj.fc1, proj.fc2)):
        nn.init.normal_(m.weight, std=0.02)
        nn.init.zeros_(m.bias)
    nn.init.zeros_(model.t_block[1].weight)
    nn.init.zeros_(model.t_block[1].bias)
    for b in model.blocks:
        b.reset_parameters()
    model.final.reset_parameters()
