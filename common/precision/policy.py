"""One precision policy for every layout: fp32 master weights, a compute dtype, a reduce dtype.

FSDP2 applies it through its MixedPrecisionPolicy (parameters cast once per all-gather, gradients
reduce-scattered in reduce_dtype). Every other layout (one device, DDP, TP without FSDP, PP
stages) runs forward and loss under torch.autocast in compute_dtype: parameters, gradients and
optimizer state stay fp32 and DDP all-reduces fp32 gradients. Either way the matmuls run in
compute_dtype and the optimizer steps fp32 weights.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class PrecisionPolicy:
    param_dtype: torch.dtype = torch.float32  # master weights and optimizer state
    compute_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32

    @property
    def mixed(self) -> bool:
        return self.compute_dtype != self.param_dtype

    def fsdp_mp_policy(self):
        """The FSDP2 MixedPrecisionPolicy, or None when compute is the parameter dtype."""
        if not self.mixed and self.reduce_dtype == self.param_dtype:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy
        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=self.reduce_dtype)

    def autocast(self, device: torch.device, *, fsdp: bool):
        """Forward + loss context for layouts FSDP does not cast (fsdp=False); a no-op otherwise."""
        if fsdp or not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.compute_dtype)

    def describe(self) -> str:
        name = {v: k for k, v in DTYPES.items()}
        return (f"params {name[self.param_dtype]}, compute {name[self.compute_dtype]}, "
                f"reduce {name[self.reduce_dtype]}")


def default_policy(device: torch.device) -> PrecisionPolicy:
    """bf16 compute on CUDA; fp32 on CPU, whose cores have no bf16 units (bf16 matmul ~75x slower)."""
    return PrecisionPolicy(compute_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)


def resolve_policy(cfg, device: torch.device) -> PrecisionPolicy:
    """cfg: the PrecisionConfig (compute auto | fp32 | bf16, reduce fp32 | bf16)."""
    compute = default_policy(device).compute_dtype if cfg.compute == "auto" else DTYPES[cfg.compute]
    return PrecisionPolicy(compute_dtype=compute, reduce_dtype=DTYPES[cfg.reduce])
