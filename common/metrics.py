"""Throughput, MFU and the three log sinks: console progress bar, TensorBoard, metrics.jsonl.

MFU divides achieved model FLOP/s by the dense peak of the dtype the matmuls run in: the published
figure on a known GPU (common/precision/hardware.py), a measured large matmul on CPU. `mfu_matmul`
is the same work over that measured matmul on every device.

metrics.jsonl is the machine-readable record that tests and benchmarks read: one JSON object per
logged step (plus event lines such as resumes), appended and flushed line by line so a killed run
keeps everything it logged. It holds one timeline, as TensorBoard's purge does: a run resuming at
step S moves the records of steps after S (which it logs again), and a killed run's torn last line,
to metrics.abandoned.jsonl.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch

from common.dist import all_gather_floats, distributed
from common.durable import append_durably, write_text_durably


def meta_forward_flops(build, make_args) -> int:
    """Forward FLOPs (2 per multiply-add) of build()(*make_args()), counted by
    torch.utils.flop_counter on the meta device: no compute, no memory, the global RNG untouched.
    For models whose FLOPs are easier counted than written out (the diffusers-backed denoisers)."""
    from torch.utils.flop_counter import FlopCounterMode
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model, args = build(), make_args()
        with FlopCounterMode(display=False) as counter:
            model(*args)
    return int(counter.get_total_flops())


def measure_matmul_peak(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024, reps: int = 8) -> float:
    """Achieved FLOP/s of a large square matmul: the practical peak that CPU-MFU is measured against."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


_MEASURED: dict[tuple, float] = {}


def measured_matmul_peak(device: torch.device, dtype: torch.dtype) -> float:
    """measure_matmul_peak once per process and device/dtype. On CPU under torchrun, once per
    host: its first local rank measures while the others wait in the all-gather that shares the
    figure (ranks sharing a CPU and measuring at once would each see a fraction of the cores;
    taking turns would cost every rank a measurement of start-up)."""
    key = (device.type, device.index, dtype)
    if key not in _MEASURED:
        n = 1024 if device.type == "cpu" else 8192
        if device.type == "cpu" and distributed():
            rank = torch.distributed.get_rank()
            local = int(os.environ.get("LOCAL_RANK", rank))
            values = all_gather_floats(measure_matmul_peak(device, dtype, n=n) if local == 0 else 0.0)
            # torchrun numbers each host's ranks contiguously: the leader is rank - local rank
            # (any measured figure if a launcher numbered them otherwise).
            _MEASURED[key] = values[rank - local] or max(values)
        else:
            _MEASURED[key] = measure_matmul_peak(device, dtype, n=n)
    return _MEASURED[key]


@dataclass(frozen=True)
class Peak:
    """What MFU divides by: `flops` per rank and where the number comes from."""
    flops: float
    source: str  # "published h200-sxm bf16", "measured fp32 matmul (2 threads)", "train.peak_flops"
    matmul_flops: float = 0.0  # a measured large matmul in the compute dtype (0: not measured)


def resolve_peak(device: torch.device, compute_dtype: torch.dtype, override: float = 0.0) -> Peak:
    """The dense peak of the compute dtype: the published figure for a known GPU (never a bf16
    peak for an fp32 run), a measured matmul on CPU or an unknown GPU, or train.peak_flops."""
    from common.precision.hardware import detect, dtype_name
    measured = measured_matmul_peak(device, compute_dtype)
    if override > 0:
        return Peak(override, "train.peak_flops", measured)
    spec = detect(device)
    if spec is not None:
        key = dtype_name(compute_dtype)
        return Peak(spec.peak(key), f"published {spec.name} {key}", measured)
    name = str(compute_dtype).removeprefix("torch.")
    threads = f" ({torch.get_num_threads()} threads)" if device.type == "cpu" else ""
    return Peak(measured, f"measured {name} matmul{threads}", measured)


def memory_stats(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"mem_alloc_gb": torch.cuda.max_memory_allocated(device) / 2**30}
    try:
        import resource
        return {"max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    except Exception:
        return {}


def device_time(events) -> tuple[float, list[tuple[str, float]]]:
    """From profiler events: microseconds the device was busy (the union of its kernel, memcpy
    and memset intervals, so overlapping streams count once) and the device spans of user
    annotations by name, longest first."""
    intervals, spans = [], {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU:
            continue
        if e.is_user_annotation:
            spans[e.name] = spans.get(e.name, 0.0) + e.time_range.elapsed_us()
        else:
            intervals.append((e.time_range.start, e.time_range.end))
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy, sorted(spans.items(), key=lambda kv: -kv[1])


def operator_times(averages, steps: int, device: bool) -> list[tuple[str, float, int]]:
    """(name, ms per step, calls per step) from prof.key_averages(), longest first. device: the
    device's kernels by their time (an operator's row repeats the time of the kernels it launched,
    and a user annotation's device row, e.g. Optimizer.step, is its span, idle gaps included);
    else every row by self CPU time."""
    rows = []
    for e in averages:
        if device and (e.device_type == torch.autograd.DeviceType.CPU or e.is_user_annotation):
            continue
        t = e.self_device_time_total if device else e.self_cpu_time_total
        if t > 0:
            rows.append((e.key, t / 1e3 / steps, e.count // steps))
    return sorted(rows, key=lambda r: -r[1])


class InputWait:
    """How much of the logged steps' time went to inputs, split into waiting for the loader
    (`fetch`: the workers' decoding and reading) and preparing batches in the training process
    (`prepare`: frozen text tower, VAE, noise), with a warning when inputs take more than
    `warn_frac` of a window. Both are host time: on a GPU, what prepare launches runs
    asynchronously and shows up in the step's device time instead. The first window is not
    judged (workers start, caches fill), and a warning is repeated at most every `repeat`
    windows."""

    def __init__(self, warn_frac: float, repeat: int = 10):
        self.warn_frac, self.repeat = warn_frac, repeat
        self.fetch_s = self.prepare_s = 0.0
        self.windows, self.last_warned = 0, None

    def add(self, fetch_s: float, prepare_s: float) -> None:
        self.fetch_s += fetch_s
        self.prepare_s += prepare_s

    def end_window(self, elapsed: float, step: int, num_workers: int) -> tuple[dict, dict | None, str | None]:
        """(metrics fields, event or None, message or None) for the window just logged; resets it."""
        elapsed = max(elapsed, 1e-9)
        fetch, prepare = self.fetch_s / elapsed, self.prepare_s / elapsed
        fields = {"input_frac": fetch + prepare, "fetch_frac": fetch, "prepare_frac": prepare}
        self.fetch_s = self.prepare_s = 0.0
        self.windows += 1
        judged = self.windows > 1 and self.warn_frac > 0
        due = self.last_warned is None or self.windows - self.last_warned >= self.repeat
        if not (judged and due and fetch + prepare >= self.warn_frac):
            return fields, None, None
        self.last_warned = self.windows
        if fetch >= prepare:
            advice = (f"the loader is too slow: more workers (data.num_workers={num_workers}), faster storage, "
                      "or lighter decoding")
        else:
            advice = ("the training process's own preparation is slow: where the pipeline runs frozen "
                      "towers (text encoder, VAE), precompute their outputs (python -m data.precompute)")
        message = (f"step {step}: inputs took {fetch + prepare:.0%} of the last window's time ({fetch:.0%} waiting "
                   f"for the loader, {prepare:.0%} preparing batches); {advice}")
        event = {"event": "input_bound", "step": step, **fields}
        return fields, event, message


class StepProfiler:
    """train.profile_at / profile_count: torch.profiler over steps [start, start + count), written
    per rank as a table of operators by self time (device time on a GPU) and a Chrome trace. A run
    resumed past `start` profiles nothing."""

    TOP = 10  # operators named in the metrics.jsonl event

    def __init__(self, window: tuple[int, int] | None, run_dir: str, rank: int, device: torch.device):
        self.window, self.rank, self.device = window, rank, device
        self.out_dir = os.path.join(run_dir, "profile")
        self.prof = None

    def before_step(self, step: int) -> None:
        """`step`: the number of the step about to run (1-based)."""
        if self.window is not None and step == self.window[0]:
            from torch.profiler import ProfilerActivity, profile
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.prof = profile(activities=activities, record_shapes=False)
            self.prof.__enter__()
            self.t0 = time.perf_counter()

    def after_step(self, step: int) -> dict | None:
        """Stops and writes once `step` is the window's last; returns the event to log, with
        write_s: the seconds writing took (not a step's time)."""
        if self.prof is None or step != self.window[0] + self.window[1] - 1:
            return None
        prof, self.prof = self.prof, None
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        wall_s = time.perf_counter() - self.t0
        prof.__exit__(None, None, None)
        os.makedirs(self.out_dir, exist_ok=True)
        averages = prof.key_averages()
        table = os.path.join(self.out_dir, f"rank{self.rank}.txt")
        with open(table, "w") as f:
            f.write(averages.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
                                   row_limit=60) + "\n")
        trace = os.path.join(self.out_dir, f"rank{self.rank}.json.gz")
        prof.export_chrome_trace(trace)
        steps = self.window[1]
        ops = operator_times(averages, steps, device=cuda)
        out = {"event": "profile", "steps": [self.window[0], step], "clock": "device" if cuda else "cpu",
               "wall_ms_per_step": round(1e3 * wall_s / steps, 3), "table": table, "trace": trace}
        # busy < wall: the device (on CPU: the profiled operators) waited for the host, the loader
        # or a sync; on CPU other threads (loader workers, the main thread's Python) are not in busy
        if cuda:
            busy_us, spans = device_time(prof.events())
            out["busy_ms_per_step"] = round(busy_us / 1e3 / steps, 3)
            out["spans_ms_per_step"] = [[name, round(us / 1e3 / steps, 3)] for name, us in spans[:self.TOP]]
        else:
            out["busy_ms_per_step"] = round(sum(ms for _, ms, _ in ops), 3)
        out["top_ms_per_step"] = [[name, round(ms, 3)] for name, ms, _ in ops[:self.TOP]]
        out["write_s"] = time.perf_counter() - self.t0 - wall_s
        return out

    def close(self) -> None:
        """A run that ends inside the window still stops the profiler (nothing is written)."""
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            self.prof = None


ABANDONED = "metrics.abandoned.jsonl"


def set_aside_abandoned(path: str, start_step: int) -> int:
    """Moves the lines of `path` (metrics.jsonl) logged for steps after `start_step`, and a torn
    line, to ABANDONED beside it; returns how many. Appended there and made durable first, so a
    crash in between leaves a line in both files, never in neither."""
    if not os.path.exists(path):
        return 0
    keep, moved = [], []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line) if line.endswith("\n") else None
            except ValueError:
                rec = None
            if rec is None or (isinstance(rec.get("step"), int) and rec["step"] > start_step):
                moved.append(line if line.endswith("\n") else line + "\n")
            else:
                keep.append(line)
    if not moved:
        return 0
    append_durably(os.path.join(os.path.dirname(path), ABANDONED), "".join(moved))
    write_text_durably(path, "".join(keep))
    return len(moved)


class MetricsLogger:
    """Rank 0 writes; other ranks get a logger that does nothing."""

    def __init__(self, run_dir: str, enabled: bool, total_steps: int, start_step: int, progress: bool):
        self.enabled = enabled
        self.set_aside = 0  # lines moved to ABANDONED at the start (see set_aside_abandoned)
        self.bar = None
        self.tb = None
        self.jsonl = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, "metrics.jsonl")
        self.set_aside = set_aside_abandoned(path, start_step)
        self.jsonl = open(path, "a", buffering=1)
        try:
            from torch.utils.tensorboard import SummaryWriter
            # purge_step drops events a killed run logged past the checkpoint it resumes from.
            self.tb = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=start_step + 1 if start_step else None)
        except Exception as e:  # TensorBoard is optional for the loop itself
            print(f"warning: TensorBoard disabled ({e})")
        if progress:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, smoothing=0.1)

    def event(self, **fields) -> None:
        if self.jsonl:
            self.jsonl.write(json.dumps({"time": time.time(), **fields}) + "\n")

    def log(self, step: int, scalars: dict) -> None:
        if not self.enabled:
            return
        self.jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
        if self.tb:
            for k, v in scalars.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(f"train/{k}", v, step)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{scalars.get('loss', float('nan')):.4f}", lr=f"{scalars.get('lr', 0):.2e}", refresh=False)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb:
            self.tb.close()
        if self.jsonl:
            self.jsonl.close()
