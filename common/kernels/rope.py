"""Rotary position embedding for 1-D, 2-D and 3-D positions.

Convention: rotate-half (GPT-NeoX / Llama-HF): channel i pairs with channel i + D/2. The head
dim is split across axes: axis a owns dims_per_axis[a] channels, i.e. dims_per_axis[a] / 2
frequency pairs, laid out axis after axis in the first half and repeated in the second half.
Tables are fp32 (angles for large positions lose precision in bf16). The "triton" backend
(common/kernels/triton/rope.py) rotates in one pass reading x through its strides.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .backend import dispatch_device, resolve_backend, unserved


def rope_frequencies(positions: torch.Tensor, dims_per_axis: Sequence[int], theta: float = 10000.0):
    """positions (L, n_axes) (or (L,) for 1-D) -> (freqs_cos, freqs_sin), each (L, sum(dims))."""
    if positions.dim() == 1:
        positions = positions[:, None]
    if positions.shape[1] != len(dims_per_axis):
        raise ValueError(f"positions has {positions.shape[1]} axes, dims_per_axis {len(dims_per_axis)}")
    angles = []
    for a, d in enumerate(dims_per_axis):
        if d % 2:
            raise ValueError(f"rope dims per axis must be even, got {d}")
        inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=positions.device) / d)
        angles.append(positions[:, a].to(torch.float64)[:, None] * inv_freq[None, :])
    ang = torch.cat(angles, dim=-1)
    ang = torch.cat([ang, ang], dim=-1)  # rotate-half layout
    return ang.cos().float(), ang.sin().float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor,
               *, backend: str | None = None) -> torch.Tensor:
    """x (B, H, L, D); freqs (L, D) or broadcastable. Computed in fp32, cast back."""
    impl = resolve_backend(backend, op="rope", device=dispatch_device(x, freqs_cos, freqs_sin))
    if freqs_cos.shape[-1] != x.shape[-1]:
        raise ValueError(f"rope table dim {freqs_cos.shape[-1]} != head dim {x.shape[-1]}")
    if impl == "triton":
        from .triton import rope as triton_rope  # lazy: triton is imported only when used
        if triton_rope.supports(x, freqs_cos, freqs_sin):
            return triton_rope.apply_rope(x, freqs_cos, freqs_sin)
        unserved("apply_rope", backend, triton_rope.SUPPORTED)
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    c, s = freqs_cos.to(xf.dtype), freqs_sin.to(xf.dtype)
    if torch.compiler.is_compiling():
        # Per half, (x1 c1 - x2 s1, x2 c2 + x1 s2): the cat of a negated half in x c +
        # rotate_half(x) s became extra full-size passes in Inductor's backward (compiled demo
        # step, 1 thread: QK-norm + RoPE kernels 1.46 -> 0.90 ms per block backward, 0.58 -> 0.17
        # forward). Eager keeps the rotate-half form, whose fewer ATen ops are 30% faster there.
        h = xf.shape[-1] // 2
        x1, x2 = xf[..., :h], xf[..., h:]
        y = torch.cat([x1 * c[..., :h] - x2 * s[..., :h], x2 * c[..., h:] + x1 * s[..., h:]], dim=-1)
    else:
        y = torch.addcmul(xf * c, _rotate_half(xf), s)
    return y.to(x.dtype)
