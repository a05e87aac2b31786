"""MFU says what it is measured against: the published dense peak of the compute dtype on a known
GPU (never a bf16 peak for an fp32 run), a measured matmul on CPU, measured once per process."""
from __future__ import annotations

import pytest
import torch

from common import metrics
from common.precision import hardware


@pytest.fixture
def fake_gpu(monkeypatch):
    calls = []

    def fake_measure(device, dtype, n=1024, reps=8):
        calls.append((device.type, dtype))
        return 123e12

    monkeypatch.setattr(metrics, "measure_matmul_peak", fake_measure)
    monkeypatch.setattr(metrics, "_MEASURED", {})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    return calls


def test_published_peak_follows_the_compute_dtype(fake_gpu):
    cuda = torch.device("cuda", 0)
    bf16 = metrics.resolve_peak(cuda, torch.bfloat16)
    assert bf16.flops == hardware.DEVICES["h200-sxm"].peak("bf16") == 989.4e12
    assert bf16.source == "published h200-sxm bf16" and bf16.matmul_flops == 123e12
    fp32 = metrics.resolve_peak(cuda, torch.float32)
    expected = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    assert fp32.source == f"published h200-sxm {expected}" and fp32.flops < bf16.flops
    assert metrics.resolve_peak(cuda, torch.bfloat16, override=5e14).flops == 5e14


def test_matmul_peak_measured_once_per_process(fake_gpu):
    cpu = torch.device("cpu")
    first = metrics.resolve_peak(cpu, torch.float32)
    second = metrics.resolve_peak(cpu, torch.float32)
    assert first.flops == second.flops == 123e12 and first.source.startswith("measured float32 matmul")
    assert fake_gpu == [("cpu", torch.float32)]


def test_unknown_gpu_falls_back_to_the_measured_matmul(fake_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    peak = metrics.resolve_peak(torch.device("cuda", 0), torch.bfloat16)
    assert peak.flops == 123e12 and peak.source == "measured bfloat16 matmul"


def test_device_table_names():
    assert hardware.detect(torch.device("cpu")) is None
    assert hardware.dtype_name(torch.float32, allow_tf32=False) == "fp32"
    assert hardware.dtype_name(torch.bfloat16) == "bf16"
    with pytest.raises(KeyError, match="a100-sxm: no published peak for fp8"):
        hardware.DEVICES["a100-sxm"].peak("fp8")


def _two_ranks_measure(rank, world_size):
    calls = []

    def fake_measure(device, dtype, n=1024, reps=8):
        calls.append(rank)
        return 1e12 * (rank + 1)

    metrics.measure_matmul_peak = fake_measure
    metrics._MEASURED.clear()
    first = metrics.measured_matmul_peak(torch.device("cpu"), torch.float32)
    again = metrics.measured_matmul_peak(torch.device("cpu"), torch.float32)
    return first, again, calls


@pytest.mark.dist
def test_cpu_ranks_of_one_host_share_one_measurement():
    from tests.dist_harness import run_ranks
    results = run_ranks(_two_ranks_measure, 2)
    # Local rank 0 measured once; rank 1 took its figure and measured nothing.
    assert results == [(1e12, 1e12, [0]), (1e12, 1e12, [])], results


def test_device_time_is_the_union_of_device_intervals_without_annotation_spans():
    """The profiler's device busy time: overlapping kernels (two streams) count once, a gap
    counts nothing, CPU events are not device time, and a user annotation's device span (idle
    gaps included) is reported apart, not added."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Interval

    from common.metrics import device_time

    def ev(name, start, end, device=DeviceType.CUDA, annotation=False):
        return SimpleNamespace(name=name, time_range=Interval(start, end), device_type=device,
                               is_user_annotation=annotation)
    events = [ev("gemm", 0, 10), ev("copy", 5, 12), ev("norm", 20, 25), ev("aten::mm", 0, 100, DeviceType.CPU),
              ev("Optimizer.step", 0, 40, annotation=True), ev("FSDP::pre_forward", 30, 35, annotation=True),
              ev("Optimizer.step", 50, 60, annotation=True)]
    busy, spans = device_time(events)
    assert busy == 12 + 5
    assert spans == [("Optimizer.step", 50), ("FSDP::pre_forward", 5)]
