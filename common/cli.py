"""Entrypoint wrapper: user mistakes become one line on stderr and exit code 2, not a traceback."""
from __future__ import annotations

import errno
import os
import sys
from typing import Callable


def count_arg(minimum: int, zero_ok: bool = False) -> Callable[[str], int]:
    """An argparse `type` for a count >= minimum (or 0, where 0 turns a feature off)."""
    import argparse

    def parse(text: str) -> int:
        n = int(text)
        if n < minimum and not (zero_ok and n == 0):
            raise argparse.ArgumentTypeError(f"{n}: must be {'0 or ' if zero_ok else ''}>= {minimum}")
        return n
    parse.__name__ = "int"  # argparse's message for a non-number: "invalid int value"
    return parse


def add_checkpoint_arg(p) -> None:
    """--checkpoint DIR of the commands that load a run (sample, eval, export)."""
    p.add_argument("--checkpoint", default=None, help="a specific checkpoint directory, e.g. RUN/checkpoints/"
                                                      "step_00001200 (default: the run's latest)")


def noise_levels_arg(allow_empty: bool = True) -> Callable[[str], list[float]]:
    """An argparse `type` for comma-separated noise levels in (0, 1] (1: pure noise)."""
    import argparse

    def parse(text: str) -> list[float]:
        try:
            ts = [float(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected numbers like 0.6,0.9") from None
        if any(not 0 < t <= 1 for t in ts):
            raise argparse.ArgumentTypeError(f"{text!r}: every t must be in (0, 1]")
        if not ts and not allow_empty:
            raise argparse.ArgumentTypeError("give at least one noise level")
        return ts
    parse.__name__ = "noise levels"
    return parse


def user_error_types() -> tuple[type[BaseException], ...]:
    from common.checkpoint import CheckpointError
    from common.config import ConfigError
    from common.data import DataError
    from common.trainer import TrainingError
    return (ConfigError, DataError, CheckpointError, TrainingError, FileNotFoundError)


# Failures of the storage rather than of the program: a full disk, quota, read-only or
# unwritable run directory. One line naming the file; the run's last checkpoint stays usable.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO})


def storage_error(e: BaseException) -> str | None:
    """The one-line message for a storage failure (also one raised inside a DCP save, which
    wraps every rank's exception with its traceback), else None."""
    if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
        where = f": {e.filename}" if e.filename else ""
        return f"cannot write{where}: {e.strerror} (disk full or run directory not writable?)"
    failures = getattr(e, "failures", None)
    if type(e).__name__ == "CheckpointException" and isinstance(failures, dict):
        for rank, (exc, _trace) in sorted(failures.items()):
            inner = storage_error(exc)
            if inner is not None:
                return f"checkpoint save failed on rank {rank}: {inner}"
        rank, (exc, _trace) = sorted(failures.items())[0]
        return f"checkpoint save failed on rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    return None


def _fail(message: str) -> None:
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
    print(f"{prefix}error: {message}", file=sys.stderr, flush=True)


def run_cli(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> None:
    try:
        code = main(argv)
    except KeyboardInterrupt:
        if os.environ.get("MMP_TRACEBACK"):
            raise
        _fail("interrupted")
        sys.exit(130)
    except BaseException as e:  # noqa: B036 - DCP's CheckpointException derives from BaseException
        message = str(e) if isinstance(e, user_error_types()) else storage_error(e)
        if message is None:
            raise
        _fail(message)
        if os.environ.get("MMP_TRACEBACK"):
            raise
        from common.dist import teardown
        teardown()
        sys.exit(2)
    sys.exit(code or 0)
