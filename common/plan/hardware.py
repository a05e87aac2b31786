"""The accelerators and the network the planner prices a layout on.

Peaks come from common/precision/hardware.py (the vendors' dense figures, the same that MFU is
reported against); the memory is what torch reports as total on the 80 GB / 141 GB parts.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.precision.hardware import DEVICES


@dataclass(frozen=True)
class GPU:
    name: str
    memory: float        # bytes
    peak_bf16: float     # dense FLOP/s
    hbm_bw: float        # bytes/s
    nvlink: float = 450e9  # per GPU, one direction: NVLink 4 (H100/H200); NVLink 3 (A100) 300 GB/s
    ib: float = 50e9       # one 400 Gb/s NDR NIC per GPU; A100 nodes: 200 Gb/s HDR

    def describe(self) -> str:
        return (f"{self.name}: {self.memory / 2**30:.1f} GiB, {self.peak_bf16 / 1e12:.0f} TFLOP/s bf16 dense, "
                f"{self.hbm_bw / 1e12:.2f} TB/s HBM")


def _gpu(name: str, spec: str, gib: float, **net) -> GPU:
    d = DEVICES[spec]
    return GPU(name, gib * 2**30, d.peak("bf16"), d.mem_bw, **net)


GPUS = {
    "h100-80g": _gpu("h100-80g", "h100-sxm", 79.1),
    "a100-80g": _gpu("a100-80g", "a100-sxm", 79.1, nvlink=300e9, ib=25e9),
    "h200-141g": _gpu("h200-141g", "h200-sxm", 139.8),
}


@dataclass(frozen=True)
class Network:
    """Per-GPU bandwidths (bytes/s, one direction) and per-hop latencies (s). A collective whose
    ranks all sit in one node of `gpus_per_node` runs at NVLink speed, else at the per-GPU share of
    the InfiniBand rail (one NIC per GPU)."""
    gpus_per_node: int = 8
    nvlink: float = 450e9
    ib: float = 50e9
    nvlink_latency: float = 3e-6
    ib_latency: float = 10e-6
