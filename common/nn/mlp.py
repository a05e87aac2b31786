"""Feed-forward blocks: GELU(tanh) MLP (DiT/PixArt) and SwiGLU (Llama-style)."""
from __future__ import annotations

import torch
from torch import nn

from common.kernels import gelu_tanh, swiglu


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, out_dim: int | None = None, bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, out_dim or dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(gelu_tanh(self.fc1(x)))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x). Callers usually pass hidden = 2/3 * 4 * dim so the parameter
    count matches a 4x GELU MLP. w1 and w3 stay separate linears so that a column-wise
    tensor-parallel shard holds matching halves of both."""

    def __init__(self, dim: int, hidden: int, out_dim: int | None = None, bias: bool = False):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w3 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, out_dim or dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x)))  # kernels dispatch: one fused pass on CUDA
