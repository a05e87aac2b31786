"""Entrypoint wrapper: user mistakes become one line on stderr and exit code 2, not a traceback."""
from __future__ import annotations

import os
import sys
from typing import Callable


def user_error_types() -> tuple[type[BaseException], ...]:
    from common.checkpoint import CheckpointError
    from common.config import ConfigError
    from common.data import DataError
    from common.trainer import TrainingError
    return (ConfigError, DataError, CheckpointError, TrainingError, FileNotFoundError)


def run_cli(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> None:
    try:
        code = main(argv)
    except user_error_types() as e:  # noqa: B030 - computed tuple of exception types
        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
        print(f"{prefix}error: {e}", file=sys.stderr, flush=True)
        if os.environ.get("MMP_TRACEBACK"):
            raise
        from common.dist import teardown
        teardown()
        sys.exit(2)
    sys.exit(code or 0)
