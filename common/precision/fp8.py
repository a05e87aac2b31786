"""FP8 training of the linears through torchao.float8, with the roofline filter.

Order: convert before tensor parallelism, FSDP and torch.compile (torchao swaps nn.Linear for
Float8Linear, whose weight FSDP then shards). Recipes:
  tensorwise  one dynamic scale per tensor (fastest; supports fp8 all-gather under FSDP2)
  rowwise     one scale per row of each GEMM operand (more accurate with outliers; no fp8 all-gather)

fp8 all-gather (tensorwise only): FSDP2 casts each weight shard to fp8 before the all-gather,
halving its bytes vs bf16; the scale must then be global, so the amax of the whole weight is
all-reduced. `fp8_after_optimizer_step` precomputes those scales for all layers at once.
Over gloo (CPU), call `fp8_all_gather_over_gloo` after fully_shard: gloo has no float8 types.

On CPU (torch 2.14), torch._scaled_mm runs and is exact (fp32 accumulation), so Float8Linear
works with emulate=False and the default keeps the real kernel on every device. Speed on CPU:
e4m3 x e4m3 with scalar scales takes a slow reference path (~0.07 GFLOP/s): the tensorwise
forward GEMM, and torchao's rowwise backward GEMMs, which it runs with unit scalar scales and
rescales after; per-row scales or an e5m2 operand go through oneDNN (15-40 GFLOP/s). Tests keep
their GEMMs small; `emulate=True` (torchao dequantizes and runs a high-precision matmul after the
same fp8 rounding of the operands) is what the train entrypoint picks on CPU, and says so at start
(the tiny text2image step: 0.65 s emulated against 245 s on the reference path).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn

from common.precision.convert import LowPrecisionReport, model_device, module_filter
from common.precision.hardware import DeviceSpec

RECIPES = ("tensorwise", "rowwise")


def convert_fp8(model: nn.Module, recipe: str, *, rows: Mapping[str, int], spec: DeviceSpec | None = None,
                fsdp_all_gather: bool = False, emulate: bool = False, force: bool = False,
                exclude: tuple[str, ...] = ()) -> LowPrecisionReport:
    """Swap, in place, the nn.Linear layers the roofline predicts faster in fp8 for Float8Linear.

    rows: record_linear_rows() of a probe forward at training shapes (linears absent from it stay
    high precision). spec: the device to predict for (None: the model's GPU if known, else H100).
    force: convert every linear with K and N multiples of 16, whatever the roofline says."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if recipe not in RECIPES:
        raise ValueError(f"unknown fp8 recipe {recipe!r}; expected one of {RECIPES}")
    if fsdp_all_gather and recipe != "tensorwise":
        raise ValueError(f"fp8 all-gather needs one scale per weight tensor (recipe 'tensorwise'); "
                         f"recipe {recipe!r} scales per row, so its weights are all-gathered in high "
                         f"precision: set fsdp_all_gather=False or use recipe='tensorwise'")
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe),
                                 enable_fsdp_float8_all_gather=fsdp_all_gather, emulate=emulate)
    keep = module_filter(rows, recipe, spec, exclude, force=force, device=model_device(model))
    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    return keep.report


def fp8_after_optimizer_step(model: nn.Module) -> None:
    """Call after every optimizer step. With fp8 all-gather, computes the next step's fp8 scales
    of all FSDP-sharded Float8Linear weights with one all-reduce of their amaxes (otherwise each
    layer's pre-all-gather cast all-reduces its own amax: one small collective per layer). A no-op
    when no weight uses fp8 all-gather."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.float8_linear import Float8Linear

    if any(isinstance(m, Float8Linear) and m.config.enable_fsdp_float8_all_gather for m in model.modules()):
        precompute_float8_dynamic_scale_for_fsdp(model)


class _BytesAllGather:
    """FSDP2 all-gather comm (the interface of torch.distributed.fsdp's AllGather) that moves
    1-byte float buffers as uint8. gloo rejects float8 tensors ("RuntimeError: Invalid scalar
    type"); FSDP2 already packs a unit's all-gather inputs into a uint8 buffer when their dtypes
    differ (fp8 weights next to fp32 biases or norm weights), so only units whose every input is
    fp8 (bias-free linears) hand gloo a float8 buffer. The bytes are the same either way."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, async_op: bool = False):
        if output_tensor.dtype.is_floating_point and output_tensor.element_size() == 1:
            output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


def fp8_all_gather_over_gloo(model: nn.Module) -> int:
    """Call after fully_shard when fp8 all-gather runs over gloo: every FSDP unit of `model`
    all-gathers fp8 shards as bytes. Returns the number of units changed (0 unless the default
    process group is gloo; NCCL all-gathers float8 natively)."""
    from torch.distributed.fsdp import FSDPModule

    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return 0
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_custom_all_gather(_BytesAllGather())
    return len(units)


def plain_tensors(state):
    """`state` (nested dicts of tensors) with torchao's fp8 all-gather weight wrapper replaced by
    the tensor it wraps, sharing storage, also inside DTensors. Checkpoints then hold plain
    tensors: they load in processes that never import torchao (sample, eval, another recipe), and
    in-place loads write straight into the parameters."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Wrapped

    if isinstance(state, dict):
        return {k: plain_tensors(v) for k, v in state.items()}
    if isinstance(state, DTensor) and isinstance(state._local_tensor, Wrapped):
        return DTensor.from_local(state._local_tensor._tensor, state.device_mesh, state.placements, run_check=False,
                                  shape=state.shape, stride=state.stride())
    if isinstance(state, Wrapped):
        return state._tensor
    return state
