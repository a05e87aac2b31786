"""Stopping a run cleanly on a scheduler's signal (train.save_on_signal).

  parse_signals(text)  'SIGTERM,SIGUSR1' -> the signals (config validation)
  StopSignals          the first such signal is only recorded; the trainer ends the step in flight,
                       every rank agrees in the step's all-reduce, saves a checkpoint and stops
  ignore_in_worker     a DataLoader worker_init_fn: forked workers ignore those signals
  grace_shortfall      whether a step plus a checkpoint write still fit the scheduler's grace period
"""
from __future__ import annotations

import os
import signal
import threading
import time


def parse_signals(text: str) -> tuple[signal.Signals, ...]:
    """'SIGTERM,SIGUSR1' (or 'none' / '') -> the signals; ValueError naming an unknown one."""
    names = [n.strip().upper() for n in text.split(",") if n.strip()]
    if names in ([], ["NONE"]):
        return ()
    out = []
    for name in names:
        full = name if name.startswith("SIG") else "SIG" + name
        sig = getattr(signal.Signals, full, None)
        if sig is None or sig in (signal.SIGKILL, getattr(signal, "SIGSTOP", None)):
            raise ValueError(f"{name!r} is not a signal a process can catch (e.g. SIGTERM, SIGUSR1, SIGINT)")
        out.append(sig)
    return tuple(dict.fromkeys(out))


_taken_in: int | None = None  # the process whose StopSignals holds the signals
_taken: dict = {}  # signal -> the handler it had before
_held_by_parent: tuple = ()  # in a forked child: the signals its parent's StopSignals holds


def _ignore_in_child() -> None:
    # A data-loader worker forked during training: a signal sent to the whole process group (Slurm
    # signals every process of a job step; `kill -TERM -PGID`) must not end it in the middle of the
    # step the trainer is finishing, or the trainer fails on the lost worker instead of saving. The
    # trainer ends its workers as it exits, and they exit by themselves when it is gone.
    global _taken_in, _held_by_parent
    if _taken_in is not None and _taken_in != os.getpid():
        _held_by_parent = tuple(_taken)
        _taken.clear()
        _taken_in = None
        ignore_in_worker()


def ignore_in_worker(worker_id: int | None = None) -> None:
    """A DataLoader's worker_init_fn: torch's workers install their own SIGTERM handler (ending
    the worker) after the fork, so the signals the parent holds are ignored again here."""
    for sig in _held_by_parent:
        signal.signal(sig, signal.SIG_IGN)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_ignore_in_child)


class StopSignals:
    """The first of `signals` only records itself (`received`); the trainer, at the end of the step
    in flight, agrees across ranks (the step's all-reduce of `flag`) that one arrived, saves a
    checkpoint and stops. Later ones, of any of them, are recorded no more: a rank under torchrun
    gets a job step's SIGTERM twice (from the scheduler, and forwarded by torchrun), and Slurm sends
    SIGTERM at the time limit after its early SIGUSR1. SIGKILL (or SIGINT, unless taken) stops at once.

    Schedulers ask a job to stop this way: Kubernetes and torchrun send SIGTERM and kill a grace
    period later, Slurm sends SIGTERM at the time limit and, with `--signal=USR1@120`, SIGUSR1 two
    minutes ahead. Taken only in the main thread, where Python runs signal handlers; close() gives
    the signals back."""

    def __init__(self, signals: tuple[signal.Signals, ...]):
        global _taken_in
        self.received: signal.Signals | None = None
        self.received_at: float | None = None  # time.monotonic() of the first one
        self._owner = False
        if not signals or threading.current_thread() is not threading.main_thread() or _taken_in is not None:
            return
        for sig in signals:
            _taken[sig] = signal.signal(sig, self._handle)
        _taken_in = os.getpid()
        self._owner = True

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
            self.received_at = time.monotonic()

    def seconds_since(self) -> float | None:
        return None if self.received_at is None else time.monotonic() - self.received_at

    @property
    def taken(self) -> bool:
        return self._owner

    @property
    def flag(self) -> float:
        """1.0 once a signal arrived: summed over ranks in the step's all-reduce."""
        return 0.0 if self.received is None else 1.0

    def close(self) -> None:
        global _taken_in
        if self._owner:
            for sig, previous in _taken.items():
                signal.signal(sig, previous)
            _taken.clear()
            _taken_in = None
            self._owner = False


def grace_shortfall(step_s: float, write_s: float, grace_s: float) -> dict | None:
    """A signal at the start of a step is saved after the rest of that step plus a checkpoint's
    write to disk (asynchronous saves too: the run waits for the write before it exits). When that
    exceeds the scheduler's grace period the SIGKILL lands mid-save: nothing is corrupted (saves
    are atomic), but the run resumes from the checkpoint before. Returns the event, or None."""
    needed = step_s + write_s
    if grace_s <= 0 or needed <= grace_s:
        return None
    return {"event": "signal_grace", "needed_s": round(needed, 3), "step_s": round(step_s, 3),
            "write_s": round(write_s, 3), "grace_s": grace_s}


def grace_message(ev: dict) -> str:
    return (f"warning: saving on a stop signal would take up to {ev['needed_s']:.3g} s (a step {ev['step_s']:.3g} s "
            f"+ a checkpoint write {ev['write_s']:.3g} s), more than the scheduler's grace period "
            f"train.signal_grace_s={ev['grace_s']:g}: its SIGKILL would cut the save off and the run would resume "
            f"from the checkpoint before. Ask for a longer grace period (Kubernetes terminationGracePeriodSeconds, "
            f"Slurm KillWait) or an earlier signal (sbatch --signal=USR1@120) and set train.signal_grace_s to it")
