"""Int8 mixed-precision training of the linears on torch._int_mm.

    forward  out = x W^T   int8: x per row (token), W per output row
    dgrad    dx  = dy W    int8: dy per row, W per column (input feature)
    wgrad    dW  = dy^T x  in the input's precision: the weight gradient sums over all tokens, and
                           its accuracy matters most to the optimizer, so it is not quantized.
Symmetric int8 with dynamic scales (absmax / 127 per row, recomputed every call), int32
accumulation, then one rescale by row scale x column scale. Scaling along the contraction
dimension's rows/columns is what lets the rescale factor out of the sum.

torchao.prototype.quantized_training has a comparable prototype (Int8MixedPrecisionTrainingConfig);
this module is our own so that (a) the layer is a plain nn.Linear subclass with nn.Linear's
parameters and state_dict keys (checkpoints load either way), (b) torch._int_mm's CUDA shape rules
are handled by padding (the prototype fails for M <= 16) and (c) 3-D inputs need no contiguity.
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from common.precision.convert import LowPrecisionReport, model_device, module_filter, swap_linears
from common.precision.hardware import DeviceSpec

INT8_MAX = 127
SCALE_EPS = 1e-12  # an all-zero row quantizes to zeros instead of dividing by zero
# torch._int_mm on CUDA needs M > 16 and K, N multiples of 8 (CPU has no limits). Zero rows and
# zero columns change nothing in the product, so the operands are padded to fit and the output
# is sliced back; the roofline filter already keeps K, N multiples of 16, so in practice only
# small-M calls (a batch of pooled vectors) pad.
MIN_ROWS, K_N_MULTIPLE = 17, 8


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of a 2-D tensor: (int8 values, fp32 scales (rows, 1)), t ~ q * scale."""
    t32 = t.float()
    scale = t32.abs().amax(dim=1, keepdim=True).clamp(min=SCALE_EPS) / INT8_MAX
    return (t32 / scale).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def _pad_to(n: int, multiple: int, minimum: int = 0) -> int:
    return max(minimum, -(-n // multiple) * multiple) - n


def int8_matmul(a: torch.Tensor, b_rows: torch.Tensor) -> torch.Tensor:
    """a @ b_rows^T with a (M, K) quantized per row and b_rows (N, K) per row (= per column of
    b_rows^T); result in a's dtype."""
    m, n = a.shape[0], b_rows.shape[0]
    qa, sa = quantize_rows(a)
    qb, sb = quantize_rows(b_rows)
    pad_k = _pad_to(a.shape[1], K_N_MULTIPLE)
    qa = F.pad(qa, (0, pad_k, 0, max(0, MIN_ROWS - m)))
    qb = F.pad(qb, (0, pad_k, 0, _pad_to(n, K_N_MULTIPLE)))
    # qb.t() is column-major, the layout cuBLASLt's int8 GEMM wants for its second operand.
    acc = torch._int_mm(qa, qb.t())[:m, :n]
    return (acc.float() * sa * sb.t()).to(a.dtype)


class _Int8MixedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = int8_matmul(x.reshape(-1, x.shape[-1]), weight)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = int8_matmul(dy, weight.t()).view(x.shape)  # weight.t(): rows are input features
        if ctx.needs_input_grad[1]:
            dw = (dy.t() @ x.reshape(-1, x.shape[-1]).to(dy.dtype)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0)
        return dx, dw, db


class Int8MixedLinear(nn.Linear):
    """nn.Linear whose forward and input-gradient GEMMs run in int8; same parameters and
    state_dict as nn.Linear."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8MixedLinear":
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        new.weight, new.bias = linear.weight, linear.bias  # the same Parameter objects
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if torch.is_autocast_enabled(x.device.type):
            # autocast does not reach inside an autograd.Function: cast here, as F.linear would be.
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        return _Int8MixedLinearFn.apply(x, weight, bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", int8 mixed precision"


def convert_int8(model: nn.Module, *, rows: Mapping[str, int], spec: DeviceSpec | None = None,
                 force: bool = False, exclude: tuple[str, ...] = ()) -> LowPrecisionReport:
    """Swap, in place, the nn.Linear layers the roofline predicts faster in int8 mixed precision
    for Int8MixedLinear (arguments as in common.precision.fp8.convert_fp8)."""
    keep = module_filter(rows, "int8", spec, exclude, force=force, device=model_device(model))
    swap_linears(model, keep, Int8MixedLinear.from_linear)
    return keep.report
