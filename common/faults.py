"""Surviving faults in long multi-rank jobs: detection, the checkpoint interval, and injection.

  HangWatchdog        a step (or collective) past train.hang_timeout_s: every thread's Python
                      stack to stderr and <run.dir>/hang_rank<r>.txt, then os._exit(EXIT_HANG)
                      so that torchrun --max-restarts restarts the job from its last checkpoint;
                      a rank that the launcher then ends with SIGTERM prints its stacks too
  StragglerMonitor    every train.straggler_every steps, the per-rank step times gathered and
                      ranks slower than train.straggler_factor x the median named
  young_daly_steps    train.ckpt_every=auto: sqrt(2 * save_s * MTBF) converted to steps
  FaultInjector       MMP_FAULT_* environment variables: kill, hang or slow a rank at a step
                      (tests and drills; nothing happens unless one is set)

What a rank times for the straggler report is its rank-local part of a step: loading and
preparing the step's micro-batches (decoding, frozen encoders, noise). The forward/backward
cannot be timed per rank from the host: DDP waits for the slowest rank inside backward and
FSDP inside forward, so every rank's wall time there is the slowest one's.
"""
from __future__ import annotations

import errno
import faulthandler
import json
import math
import multiprocessing
import os
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass

import torch

from common import dist as mdist
from common.stop_signals import parse_signals

# EX_TEMPFAIL: "try again later" - a hang is not a bug in the config, a restart may well succeed.
EXIT_HANG = 75
_STDERR_FD = 2  # the process's stderr even where sys.stderr was replaced by an object without a fileno


# --------------------------------------------------------------------------- hang watchdog
_sigterm_dump_pid: int | None = None  # the process whose watchdog registered the SIGTERM dump


def _register_sigterm_dump() -> bool:
    """SIGTERM prints every thread's stack, then terminates as before; only where SIGTERM has no
    handler. Returns whether it was registered."""
    global _sigterm_dump_pid
    if not hasattr(faulthandler, "register") or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return False
    faulthandler.register(signal.SIGTERM, file=_STDERR_FD, all_threads=True, chain=True)
    _sigterm_dump_pid = os.getpid()
    return True


def _unregister_sigterm_dump() -> None:
    global _sigterm_dump_pid
    if _sigterm_dump_pid is not None:
        faulthandler.unregister(signal.SIGTERM)
        _sigterm_dump_pid = None


def _drop_inherited_sigterm_dump() -> None:
    # A process forked while a watchdog runs (a data-loader worker started at an epoch boundary)
    # inherits the C handler; torchrun ends a rank's whole process group, and each such child
    # would print its stacks too, burying the rank's own.
    if _sigterm_dump_pid is not None and _sigterm_dump_pid != os.getpid():
        _unregister_sigterm_dump()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_inherited_sigterm_dump)


class HangWatchdog:
    """beat(what) at each unit of progress; no beat for `timeout_s` seconds ends the process.

    A Python thread does the dump and the exit. In case the stuck call holds the GIL (a C
    extension that never releases it) and that thread cannot run, faulthandler's C-level timer,
    re-armed by the thread while beats arrive, dumps to stderr and exits `grace_s` later.

    Every rank of a hung job times out at about the same moment, and the first to exit makes
    torchrun end the others with SIGTERM, possibly before their own watchdog fires. So while the
    watchdog runs, SIGTERM (where no handler was installed) first prints every thread's stack to
    stderr, from C like the timer above, then terminates as before: the rank that really hung
    shows where, whichever rank's watchdog fired."""

    def __init__(self, timeout_s: float, run_dir: str, rank: int, grace_s: float = 30.0):
        self.timeout_s = float(timeout_s)
        self.path = os.path.join(run_dir, f"hang_rank{rank}.txt")
        self.rank = rank
        self.grace_s = grace_s
        self._what = "start"
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = None
        self._dumps_on_sigterm = False
        if self.timeout_s > 0:
            self._dumps_on_sigterm = _register_sigterm_dump()
            self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
            self._thread.start()

    def beat(self, what: str) -> None:
        # Two attribute stores: no lock needed, the watcher reads a consistent-enough pair.
        self._what = what
        self._last = time.monotonic()

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            faulthandler.cancel_dump_traceback_later()
        if self._dumps_on_sigterm:
            _unregister_sigterm_dump()
            self._dumps_on_sigterm = False

    def _watch(self) -> None:
        poll = min(5.0, max(0.05, self.timeout_s / 20))
        while not self._stop.wait(poll):
            idle = time.monotonic() - self._last
            if idle >= self.timeout_s:
                self._fire(idle)
            faulthandler.dump_traceback_later(self.timeout_s - idle + self.grace_s + poll, exit=True,
                                              file=_STDERR_FD)

    def _fire(self, idle: float) -> None:
        head = (f"[rank {self.rank}] hang watchdog: no progress for {idle:.1f} s in {self._what} "
                f"(train.hang_timeout_s={self.timeout_s:g}); stacks of every thread follow, exiting with "
                f"code {EXIT_HANG} so the launcher can restart from the last checkpoint\n")
        try:
            with open(self.path, "a") as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} restart "
                        f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}: {head}")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        finally:
            os.write(_STDERR_FD, head.encode())
            faulthandler.dump_traceback(file=_STDERR_FD, all_threads=True)
            os._exit(EXIT_HANG)


# --------------------------------------------------------------------------- stragglers
@dataclass(frozen=True)
class StragglerReport:
    step: int
    times_s: list[float]  # per rank, mean over the window
    median_s: float
    slow: list[int]  # ranks above factor x median
    factor: float

    def message(self) -> str:
        names = ", ".join(f"rank {r} {self.times_s[r]:.3f} s ({self.times_s[r] / self.median_s:.1f}x)"
                          for r in self.slow)
        return (f"step {self.step}: straggler{'s' * (len(self.slow) > 1)} {names}; median rank-local step time "
                f"{self.median_s:.3f} s (threshold {self.factor:g}x)")

    def event(self) -> dict:
        return {"event": "straggler", "step": self.step, "ranks": self.slow, "times_s": self.times_s,
                "median_s": self.median_s, "factor": self.factor}


def find_stragglers(times_s: list[float], factor: float, step: int) -> StragglerReport:
    median = statistics.median(times_s)
    slow = [r for r, t in enumerate(times_s) if t > factor * median] if median > 0 else []
    return StragglerReport(step, list(times_s), median, slow, factor)


class StragglerMonitor:
    """Accumulates this rank's rank-local step time; every `every` steps all ranks gather theirs.
    Every rank calls end_step at the same steps (the gather is a collective)."""

    def __init__(self, every: int, factor: float, world_size: int):
        self.every, self.factor, self.world_size = every, factor, world_size
        self._sum, self._n = 0.0, 0

    def add(self, seconds: float) -> None:
        self._sum += seconds
        self._n += 1

    def end_step(self, step: int) -> StragglerReport | None:
        if not self.every or self.world_size < 2 or step % self.every:
            return None
        mine = self._sum / max(self._n, 1)
        self._sum, self._n = 0.0, 0
        return find_stragglers(mdist.all_gather_floats(mine), self.factor, step)


# --------------------------------------------------------------------------- checkpoint interval
def young_daly_seconds(save_s: float, mtbf_s: float) -> float:
    """Young's optimum interval between checkpoints, sqrt(2 C M): the save cost C against the
    expected rework after a failure (half an interval every M seconds). Daly's refinement
    (minus C, plus higher-order terms) changes it by under 1% while C < M / 20000, as here."""
    return math.sqrt(2.0 * save_s * mtbf_s)


def young_daly_steps(save_s: float, step_s: float, mtbf_hours: float, min_interval_s: float = 0.0) -> int:
    """The interval in steps; min_interval_s: an async save cannot start before the previous one
    finished writing."""
    interval = max(young_daly_seconds(save_s, mtbf_hours * 3600.0), min_interval_s)
    return max(1, round(interval / max(step_s, 1e-9)))


class CheckpointInterval:
    """train.ckpt_every: a fixed number of steps, or auto. With auto the first checkpoint comes
    FIRST_SAVE_STEP steps after the start (or resume; its duration is the measurement), and each
    later save updates the interval from the save and step times, the largest over ranks so that
    every rank picks the same steps."""

    FIRST_SAVE_STEP = 5  # the first step (allocations, compilation) is left out of the step time

    def __init__(self, every: int | str, mtbf_hours: float, start_step: int = 0):
        self.auto = every == "auto"
        self.every = self.FIRST_SAVE_STEP if self.auto else int(every)
        self.mtbf_hours = mtbf_hours
        self.start_step = start_step
        self.next_step = start_step + self.every
        self._step_sum, self._steps = 0.0, 0

    def add_step_time(self, step: int, seconds: float) -> None:
        if step > self.start_step + 1:
            self._step_sum += seconds
            self._steps += 1

    @property
    def mean_step_s(self) -> float | None:
        """The mean step time so far (the first step after the start left out), None before one."""
        return self._step_sum / self._steps if self._steps else None

    def due(self, step: int) -> bool:
        return step >= self.next_step if self.auto else step % self.every == 0

    def after_save(self, step: int, save_s: float, write_s: float) -> dict | None:
        """Called by every rank after a save; with auto, returns the event describing the new
        interval (save_s: the time the step blocked; write_s: until the data was on disk)."""
        if not self.auto:
            return None
        step_s = save_s if self.mean_step_s is None else self.mean_step_s
        save_s, step_s, write_s = mdist.all_reduce_floats([save_s, step_s, write_s], op="max")
        self.every = young_daly_steps(save_s, step_s, self.mtbf_hours, min_interval_s=write_s)
        self.next_step = step + self.every
        return {"event": "ckpt_interval", "step": step, "every_steps": self.every, "save_s": save_s,
                "step_s": step_s, "write_s": write_s, "mtbf_hours": self.mtbf_hours,
                "interval_s": young_daly_seconds(save_s, self.mtbf_hours * 3600.0)}


def interval_message(ev: dict) -> str:
    return (f"checkpoint interval {ev['every_steps']} steps = max(sqrt(2 x save {ev['save_s']:.3g} s x MTBF "
            f"{ev['mtbf_hours']:g} h) = {ev['interval_s']:.4g} s, write {ev['write_s']:.3g} s) / step "
            f"{ev['step_s']:.4g} s (train.ckpt_every=auto)")


# --------------------------------------------------------------------------- fault injection
class FaultInjector:
    """Faults on request, for tests and drills:

      MMP_FAULT_KILL_AT_STEP=N    SIGKILL this process when it starts step N ...
      MMP_FAULT_KILL_RANK=R       ... on rank R only (default 0); once per run directory: a marker
                                  file (<run.dir>/fault_kill_step<N>.done) keeps a restarted attempt alive
      MMP_FAULT_SIGNAL_AT_STEP=N  send MMP_FAULT_SIGNAL (default SIGTERM) to this process and its loader
                                  workers, as a scheduler signals a whole job step, as it starts step N on
                                  rank MMP_FAULT_SIGNAL_RANK (default 0); once per run directory, as kills
      MMP_FAULT_HANG_AT_STEP=N    sleep forever inside step N (MMP_FAULT_HANG_RANK=R, default: all ranks)
      MMP_FAULT_SLOW_RANK=R       sleep MMP_FAULT_SLOW_S (default 0.3) seconds in every step of rank R
      MMP_FAULT_KILL_IN_SAVE=N    SIGKILL rank 0 right after the checkpoint of step N started writing
      MMP_FAULT_KILL_IN_SYNC_SAVE=N  SIGKILL rank 0 in the synchronous save of step N, after every
                                  shard is written and before the rename (MMP_FAULT_SAVE_PAUSE_S:
                                  sleep that long there instead, for a kill from outside)
      MMP_FAULT_SAVE_ERROR=N      raise OSError(ENOSPC) on rank 0 at that point of step N's save
      MMP_FAULT_SLOW_SAVE_S=S     every save (synchronous or asynchronous) sleeps S seconds on rank 0
                                  before its rename, as slow storage would
      MMP_FAULT_NAN_LOSS_AT_STEP=N[,M..]  the step's loss becomes NaN (MMP_FAULT_BAD_VALUE=inf: inf)
      MMP_FAULT_NAN_GRAD_AT_STEP=N[,M..]  one element of one gradient becomes NaN (or inf)
      MMP_FAULT_RECORD_KEYS=1     append the sample keys of every step to <run.dir>/keys_rank<r>.jsonl
    """

    def __init__(self, env: dict, run_dir: str, rank: int):
        def num(name, cast=int, default=None):
            raw = env.get(name, "")
            return cast(raw) if raw != "" else default
        self.rank = rank
        self.kill_at = num("MMP_FAULT_KILL_AT_STEP")
        self.kill_rank = num("MMP_FAULT_KILL_RANK", default=0)
        self.kill_marker = os.path.join(run_dir, f"fault_kill_step{self.kill_at}.done")
        self.signal_at = num("MMP_FAULT_SIGNAL_AT_STEP")
        self.signal = env.get("MMP_FAULT_SIGNAL") or "SIGTERM"
        self.signal_rank = num("MMP_FAULT_SIGNAL_RANK", default=0)
        self.signal_marker = os.path.join(run_dir, f"fault_signal_step{self.signal_at}.done")
        self.hang_at = num("MMP_FAULT_HANG_AT_STEP")
        self.hang_rank = num("MMP_FAULT_HANG_RANK")
        self.slow_rank = num("MMP_FAULT_SLOW_RANK")
        self.slow_s = num("MMP_FAULT_SLOW_S", float, 0.3)
        self.kill_in_save = num("MMP_FAULT_KILL_IN_SAVE")
        steps = lambda name: {int(x) for x in env.get(name, "").split(",") if x.strip()}  # noqa: E731
        self.nan_loss_at = steps("MMP_FAULT_NAN_LOSS_AT_STEP")
        self.nan_grad_at = steps("MMP_FAULT_NAN_GRAD_AT_STEP")
        self.bad_value = float(env.get("MMP_FAULT_BAD_VALUE") or "nan")
        self.keys_path = os.path.join(run_dir, f"keys_rank{rank}.jsonl") if env.get("MMP_FAULT_RECORD_KEYS") else None

    @classmethod
    def from_env(cls, run_dir: str, rank: int) -> FaultInjector | None:
        if not any(k.startswith("MMP_FAULT_") for k in os.environ):
            return None
        return cls(dict(os.environ), run_dir, rank)

    def at_step(self, step: int) -> None:
        """Called by the training loop as it starts step `step` (1-based)."""
        if self.slow_rank == self.rank:
            time.sleep(self.slow_s)
        if self.kill_at == step and self.kill_rank == self.rank and not os.path.exists(self.kill_marker):
            with open(self.kill_marker, "w") as f:
                f.write(f"killed rank {self.rank} at step {step}\n")
                f.flush()
                os.fsync(f.fileno())
            self._die(f"killing rank {self.rank} at step {step}")
        if self.signal_at == step and self.signal_rank == self.rank and not os.path.exists(self.signal_marker):
            with open(self.signal_marker, "w") as f:
                f.write(f"{self.signal} to rank {self.rank} at step {step}\n")
            sig = parse_signals(self.signal)[0]
            workers = multiprocessing.active_children()
            print(f"[rank {self.rank}] fault injection: {sig.name} at step {step} to the rank and {len(workers)} "
                  "worker(s)", file=sys.stderr, flush=True)
            for w in workers:
                os.kill(w.pid, sig)
            os.kill(os.getpid(), sig)
        if self.hang_at == step and self.hang_rank in (None, self.rank):
            print(f"[rank {self.rank}] fault injection: hanging in step {step} at {time.time():.3f}",
                  file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)

    def in_save(self, step: int) -> None:
        """Called right after an asynchronous save of `step` was started."""
        if self.kill_in_save == step and self.rank == 0:
            self._die(f"killing rank 0 while checkpoint {step} is being written")

    def corrupt_step(self, step: int, loss: float, params: list[torch.Tensor]) -> float:
        """Called by every rank with step `step`'s reduced loss and its gradients before the
        finiteness check; returns the (possibly replaced) loss."""
        if step in self.nan_grad_at:
            grad = next(p.grad for p in params if p.grad is not None)
            local = grad.to_local() if hasattr(grad, "to_local") else grad  # an FSDP shard may be empty
            if local.numel():
                local.view(-1)[0] = self.bad_value
            print(f"[rank {self.rank}] fault injection: {self.bad_value} in a gradient of step {step}",
                  file=sys.stderr, flush=True)
        if step in self.nan_loss_at:
            print(f"[rank {self.rank}] fault injection: loss of step {step} = {self.bad_value}", file=sys.stderr,
                  flush=True)
            return self.bad_value
        return loss

    def record_keys(self, step: int, batches: list[dict]) -> None:
        """The keys this rank trains on in step `step` (a resumed run appends the redone steps again)."""
        if self.keys_path is None:
            return
        with open(self.keys_path, "a") as f:
            # attempt: one launch of the job (all its ranks), to tell redone steps from the originals
            attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', os.getpid())}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
            f.write(json.dumps({"step": step, "attempt": attempt, "time": time.time(),
                                "keys": [k for b in batches for k in b["__key__"]]}) + "\n")

    def _die(self, what: str) -> None:
        print(f"[rank {self.rank}] fault injection: {what}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def slow_save() -> None:
    """MMP_FAULT_SLOW_SAVE_S (see FaultInjector), called where rank 0 makes a save a checkpoint."""
    pause = float(os.environ.get("MMP_FAULT_SLOW_SAVE_S") or 0)
    if pause:
        print(f"[rank 0] fault injection: a save slowed by {pause:g} s", file=sys.stderr, flush=True)
        time.sleep(pause)


def in_sync_save(step: int, rank: int, tmp_dir: str) -> None:
    """Called by CheckpointManager.save between the shard writes of step `step` (all in `tmp_dir`)
    and the rename that makes them a checkpoint: MMP_FAULT_KILL_IN_SYNC_SAVE / SAVE_PAUSE_S /
    SAVE_ERROR (see FaultInjector). Read from the environment here: the manager holds no injector."""
    env = os.environ
    if rank != 0 or not any(k.startswith("MMP_FAULT_") for k in env):
        return
    if env.get("MMP_FAULT_SAVE_ERROR") == str(step):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(tmp_dir, "__0_0.distcp"))
    if env.get("MMP_FAULT_KILL_IN_SYNC_SAVE") == str(step):
        pause = float(env.get("MMP_FAULT_SAVE_PAUSE_S") or 0)
        if pause:
            print(f"[rank {rank}] fault injection: pausing {pause:g} s before renaming {tmp_dir}", file=sys.stderr,
                  flush=True)
            time.sleep(pause)
            return
        print(f"[rank {rank}] fault injection: killing rank 0 between the shard writes and the rename of {tmp_dir}",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
