"""Roofline filter: is a linear layer predicted to train faster in fp8 / int8 than in bf16?

A linear with M rows (tokens), K in-features and N out-features runs three GEMMs per step:
    forward  out = x W^T    (M x K) @ (K x N)
    dgrad    dx  = dy W     (M x N) @ (N x K)
    wgrad    dW  = dy^T x   (N x M) @ (M x K)
Each GEMM costs max(flops / peak, bytes / mem_bw) on the device's published figures
(common.precision.hardware). Low precision halves the GEMM's operand bytes and doubles its peak,
but every operand it quantizes first costs memory passes over the bf16 tensor: one read for the
amax, one read + 1-byte write for the cast (5 bytes per element). Those passes are what make
small or memory-bound linears (few rows, like the adaLN projection with M = batch) slower in
low precision; large square GEMMs are compute-bound and gain almost the full 2x.

Modes (which operands are quantized, and how often):
  tensorwise  fp8, one scale per tensor: x, W and dy are each cast once and reused by both GEMMs
              that read them (a transposed copy of an fp8 tensor is ignored: 2 bytes/element).
  rowwise     fp8, one scale per row of each GEMM operand along its contraction dim: the scales
              of a tensor differ between GEMMs, so x, W and dy are each cast twice (6 casts).
  int8        int8 mixed precision: forward and dgrad in int8 (x per row, W per output row for
              forward and per input column for dgrad, dy per row: 4 casts); wgrad stays bf16.
              torch._int_mm returns int32, so its output is written at 4 bytes and rescaled to
              bf16 in a separate pass (read 4, write 2 bytes per element).
Fixed kernel-launch latency is not modelled: it would only push small layers further towards
bf16, which the memory passes already do.
"""
from __future__ import annotations

import torch

from common.precision.hardware import DEVICES, DeviceSpec, detect

MODES = ("tensorwise", "rowwise", "int8")
BF16_BYTES, LOWP_BYTES, INT32_BYTES = 2, 1, 4
CAST_BYTES_PER_ELEMENT = 2 * BF16_BYTES + LOWP_BYTES  # amax read + cast read + 1-byte write = 5
# FP8 GEMMs (cuBLASLt _scaled_mm) need K and N multiples of 16; the int8 path uses the same rule
# (torch._int_mm on CUDA needs multiples of 8) so one filter serves every mode.
ALIGNMENT = 16
# CPU runs (tests, planning on a laptop) decide as the target accelerator would, so what a CPU
# run converts is what the GPU run converts; H100 SXM is the part the project is sized for.
DEFAULT_DEVICE = "h100-sxm"


def resolve_spec(spec: DeviceSpec | None = None, device: torch.device | None = None) -> DeviceSpec:
    """`spec` if given, else the table entry of a known CUDA device, else the H100 SXM default."""
    if spec is not None:
        return spec
    if device is not None:
        detected = detect(device)
        if detected is not None:
            return detected
    return DEVICES[DEFAULT_DEVICE]


def _gemm_s(m: int, k: int, n: int, peak: float, mem_bw: float, in_bytes: int, out_bytes: int) -> float:
    """(m x k) @ (k x n): the slower of its compute and its operand + output traffic."""
    flops = 2 * m * k * n
    traffic = in_bytes * (m * k + k * n) + out_bytes * m * n
    return max(flops / peak, traffic / mem_bw)


def predict(m: int, k: int, n: int, mode: str, spec: DeviceSpec | None = None) -> dict:
    """Predicted seconds of one forward + backward of a linear: bf16 vs `mode`.

    Returns {"bf16_s", "lowp_s", "lowp_gemm_s", "cast_s", "speedup" (bf16_s / lowp_s)}."""
    if mode not in MODES:
        raise ValueError(f"unknown low-precision mode {mode!r}; expected one of {MODES}")
    spec = resolve_spec(spec)
    bw = spec.mem_bw
    bf16_peak = spec.peak("bf16")
    shapes = {"forward": (m, k, n), "dgrad": (m, n, k), "wgrad": (n, m, k)}
    bf16_s = sum(_gemm_s(*s, bf16_peak, bw, BF16_BYTES, BF16_BYTES) for s in shapes.values())

    x, w, dy = m * k, n * k, m * n  # element counts of the three quantizable operands
    if mode == "int8":
        peak = spec.peak("int8")
        gemm_s = sum(_gemm_s(*shapes[g], peak, bw, LOWP_BYTES, INT32_BYTES) for g in ("forward", "dgrad"))
        gemm_s += _gemm_s(*shapes["wgrad"], bf16_peak, bw, BF16_BYTES, BF16_BYTES)
        rescale_bytes = (INT32_BYTES + BF16_BYTES) * (m * n + m * k)  # int32 out -> bf16, per int8 GEMM
        cast_bytes = CAST_BYTES_PER_ELEMENT * (x + 2 * w + dy) + rescale_bytes
    else:
        peak = spec.peak("fp8")
        gemm_s = sum(_gemm_s(*s, peak, bw, LOWP_BYTES, BF16_BYTES) for s in shapes.values())
        casts_per_operand = 1 if mode == "tensorwise" else 2
        cast_bytes = CAST_BYTES_PER_ELEMENT * casts_per_operand * (x + w + dy)
    cast_s = cast_bytes / bw
    lowp_s = gemm_s + cast_s
    return {"bf16_s": bf16_s, "lowp_s": lowp_s, "lowp_gemm_s": gemm_s, "cast_s": cast_s,
            "speedup": bf16_s / lowp_s}


def should_convert(m: int, k: int, n: int, mode: str, spec: DeviceSpec | None = None,
                   margin: float = 0.05) -> tuple[bool, str]:
    """(True, why) when `mode` is predicted at least `margin` (fraction) faster than bf16 and the
    GEMM dimensions suit the low-precision kernels; else (False, reason). Reasons start with a
    category ("K/N not multiple of 16", "no <dtype> peak", "predicted slower") that reports count."""
    spec = resolve_spec(spec)
    if k % ALIGNMENT or n % ALIGNMENT:
        return False, f"K/N not multiple of {ALIGNMENT}: K={k}, N={n}"
    dtype = "int8" if mode == "int8" else "fp8"
    if dtype not in spec.peak_flops:
        return False, f"no {dtype} peak: {spec.name} has no {dtype} GEMMs"
    p = predict(m, k, n, mode, spec)
    if p["speedup"] < 1 + margin:
        return False, (f"predicted slower: {p['speedup']:.2f}x bf16 speed, need {1 + margin:.2f}x "
                       f"(M={m}, K={k}, N={n} on {spec.name})")
    return True, f"predicted {p['speedup']:.2f}x bf16 speed (M={m}, K={k}, N={n} on {spec.name})"
