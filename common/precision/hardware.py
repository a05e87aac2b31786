"""Published dense peaks and memory bandwidth of the accelerators the project targets.

MFU is reported against the peak of the dtype the matmuls actually run in (never a bf16 peak for
an fp32 run); the fp8/int8 roofline filter compares predicted GEMM times with the same figures.
Numbers are the vendors' dense (no 2:4 sparsity) datasheet values for the SXM parts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_flops: dict[str, float]  # compute dtype ("fp32", "tf32", "bf16", "fp8", "int8") -> FLOP/s (int8: OP/s)
    mem_bw: float  # HBM bytes/s

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise KeyError(f"{self.name}: no published peak for {dtype}")
        return self.peak_flops[dtype]


_HOPPER = {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.4e12, "fp8": 1978.9e12, "int8": 1978.9e12}
DEVICES: dict[str, DeviceSpec] = {
    "h100-sxm": DeviceSpec("h100-sxm", _HOPPER, 3.35e12),
    "h200-sxm": DeviceSpec("h200-sxm", _HOPPER, 4.8e12),  # same SMs and clocks as H100 SXM, more and faster HBM
    "a100-sxm": DeviceSpec("a100-sxm", {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "int8": 624e12}, 2.039e12),
}

_NAME_PATTERNS = (("h200", "h200-sxm"), ("h100", "h100-sxm"), ("a100", "a100-sxm"))


def detect(device: torch.device) -> DeviceSpec | None:
    """The table entry of a CUDA device by its name (e.g. 'NVIDIA H200'); None on CPU or unknown GPUs."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    for pattern, key in _NAME_PATTERNS:
        if pattern in name:
            return DEVICES[key]
    return None


def dtype_name(dtype: torch.dtype, *, allow_tf32: bool | None = None) -> str:
    """The peak-table key of matmuls in `dtype` (fp32 matmuls count as tf32 when TF32 is enabled)."""
    if dtype == torch.bfloat16 or dtype == torch.float16:
        return "bf16"
    if dtype == torch.float32:
        tf32 = torch.backends.cuda.matmul.allow_tf32 if allow_tf32 is None else allow_tf32
        return "tf32" if tf32 else "fp32"
    raise ValueError(f"no peak-table entry for {dtype}")
