"""Entrypoint runs forked from a warm process: the tests' way to start `python -m MODULE ...` and
`torchrun --standalone --nproc_per_node=N -m MODULE ...` without paying the imports every time.

A short training run on 2 cores is mostly start-up: torch, DCP/DTensor (sympy), dynamo (through
torchvision and pipelining) and open_clip take ~5 s of CPU before the first step, and the suite
starts hundreds of such processes. Here one forkserver per pytest worker imports them once and
every run is a fresh fork of it, with its own argv, environment, working directory, stdout and
stderr files and exit code, run through runpy as `python -m` does. Nothing a run does reaches the
server or the next run: each fork starts from the same pristine, imported state.

Multi-rank commands get what torchrun --standalone gives a worker: RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR/MASTER_PORT (rank 0 hosts the store), GROUP_RANK and
TORCHELASTIC_RESTART_COUNT=0; when one rank fails, the others are stopped, as torchrun does.
Tests of the launchers themselves (c10d rendezvous, Slurm, elastic restarts, signals sent to
torchrun), the fault-injection harness and a few CLI checks start real processes, and several of
them compare with forked reference runs; everything does with FORKED_RUNS=0.

Where a fork differs from a new process: warnings raised while importing were shown once, in the
server; every fork has the server's hash seed; the ranks' outputs are joined in rank order, not
interleaved; a failed job exits with the failing rank's status (torchrun exits 1). A run whose
environment differs from the server's (beyond what pytest and libraries set for themselves) gets
a real process and a warning in pytest's summary.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings

# What a run imports before it does anything: the forkserver imports this module once.
_WARM = ("torch", "torch.distributed.checkpoint", "torch.distributed.pipelining", "torch.distributed.fsdp",
         "common.cli", "common.run", *(f"pipelines.{p}.{m}" for p in ("text2image", "text2video", "text23d", "vlm")
                                      for m in ("config", "spec", "components")))

ENABLED = os.environ.get("FORKED_RUNS", "1") != "0"
_server_env: dict | None = None


def warm_up() -> None:
    """Imported in the forkserver (tests/forked_warm.py) before it forks anything."""
    import importlib
    for name in _WARM:
        importlib.import_module(name)
    from common.nn.text_encoder import import_open_clip
    import_open_clip()


def _mp_context(env: dict):
    """The forkserver context, its server started with `env` as its whole environment (variables
    that libraries read at import, such as OMP_NUM_THREADS, are fixed in every fork)."""
    global _server_env
    import multiprocessing as mp
    ctx = mp.get_context("forkserver")
    if _server_env is None:
        from multiprocessing import forkserver
        if getattr(forkserver._forkserver, "_forkserver_pid", None) is not None:
            # Started by something else in this worker: neither our preload nor our environment
            # applies. Runs stay correct (each fork sets its own environment) but start cold.
            warnings.warn("multiprocessing's forkserver was already running when tests/forked_runs.py first "
                          "used it: runs fork without the warm imports (slower), and import-time environment "
                          "is the other starter's", stacklevel=3)
        ctx.set_forkserver_preload(["tests.forked_warm"])
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(_comparable(env))
        try:
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _server_env = _comparable(env)
    return ctx


# Set by pytest for every test, or by a library for itself when the tests' process uses it
# (open_clip's tokenizer, inductor): a run's process sets the same for itself.
_IGNORED_ENV_PREFIXES = ("PYTEST_CURRENT_TEST", "TOKENIZERS_PARALLELISM", "TORCHINDUCTOR_", "_TORCHINDUCTOR_")


def _comparable(env: dict) -> dict:
    """The environment without _IGNORED_ENV_PREFIXES. Any other difference from the server's start
    (a test's own variable, which a library might read at import) means a real process."""
    return {k: v for k, v in env.items() if not k.startswith(_IGNORED_ENV_PREFIXES)}


def context():
    """The warm forkserver's multiprocessing context (started with the tests' environment), or
    None with FORKED_RUNS=0."""
    if not ENABLED:
        return None
    from tests.conftest import env
    return _mp_context(_server_env if _server_env is not None else env())


def _child(module: str, args: list[str], env: dict, cwd: str, out: str, err: str) -> None:
    """Runs in the fork: become `python -m module args` with this environment and output."""
    import runpy
    import traceback
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(f, fd)
        os.close(f)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # A forkserver child has "forkserver" as its default start method; a new process has the
    # platform's, under which a DataLoader's workers are the rank's own children (and notice
    # when it dies) instead of children of a nested forkserver that outlives it.
    import multiprocessing
    multiprocessing.set_start_method(None, force=True)
    sys.argv = [module, *args]
    sys.modules.pop(module, None)  # as in a fresh process: run as __main__, not found imported
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, exit status 1
        traceback.print_exc()
        sys.exit(1)
    finally:  # as the interpreter exits: join non-daemon threads, then atexit (multiprocessing skips it)
        import atexit
        import threading
        threading._shutdown()
        atexit._run_exitfuncs()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse(cmd: list[str]) -> tuple[str, list[str], int] | None:
    """(module, args, nproc) of `python -m module ...` or `python -m torch.distributed.run
    --standalone --nproc_per_node=N -m module ...`; None for any other command."""
    if len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] != "-m":
        return None
    if cmd[2] != "torch.distributed.run":
        return cmd[2], list(cmd[3:]), 1
    rest = cmd[3:]
    if len(rest) >= 4 and rest[0] == "--standalone" and rest[1].startswith("--nproc_per_node=") and rest[2] == "-m":
        return rest[3], list(rest[4:]), int(rest[1].split("=", 1)[1])
    return None


def run(cmd: list[str], env: dict, cwd: str, timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout), the
    command forked from the warm process when `parse` understands it."""
    parsed = parse(cmd) if ENABLED else None
    if parsed is not None and _server_env is not None:
        mine = _comparable(env)
        differs = sorted(k for k in set(mine) | set(_server_env) if mine.get(k) != _server_env.get(k))
        if differs:  # shown in pytest's summary: the run still works, only slower
            warnings.warn(f"forked_runs: a real process for {' '.join(cmd[1:4])}: the environment differs "
                          f"from the forkserver's in {differs}", stacklevel=3)
            parsed = None
    if parsed is None:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    module, args, nproc = parsed
    for _ in range(3):
        proc = _forked(cmd, module, args, nproc, env, cwd, timeout)
        # The store's port was free when picked and taken (by another test's sockets) before rank 0
        # bound it: the ranks stopped at rendezvous, before any work; a new port, as a relaunch would.
        if proc.returncode == 0 or nproc == 1 or "EADDRINUSE" not in proc.stderr:
            break
    return proc


def _forked(cmd, module: str, args: list[str], nproc: int, env: dict, cwd: str,
            timeout: float) -> subprocess.CompletedProcess:
    ctx = _mp_context(env)
    with tempfile.TemporaryDirectory(prefix="forked-run-") as tmp:
        port = free_port()
        procs, files = [], []
        try:
            for rank in range(nproc):
                out, err = os.path.join(tmp, f"{rank}.out"), os.path.join(tmp, f"{rank}.err")
                files.append((out, err))
                procs.append(ctx.Process(target=_child, daemon=False,
                                         args=(module, args, _rank_env(env, rank, nproc, port), cwd, out, err)))
                procs[-1].start()
            returncode = _wait(procs, timeout, cmd)
        except BaseException:  # Ctrl-C, a failed start: no rank outlives the call
            _stop(procs)
            raise
        stdout = "".join(_read(out) for out, _ in files)
        stderr = "".join(_read(err) for _, err in files)
    return subprocess.CompletedProcess(cmd, returncode, stdout, stderr)


def _rank_env(env: dict, rank: int, nproc: int, port: int) -> dict:
    """What torchrun --standalone adds to a worker's environment (nothing for one process)."""
    if nproc == 1:
        return dict(env)
    return {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0"}


def _wait(procs, timeout: float, cmd) -> int:
    """0 when every rank exits 0; else the first failing rank's status, the others stopped."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.exitcode for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed or all(c == 0 for c in codes):
            break
        if time.monotonic() > deadline:
            _stop(procs)
            raise subprocess.TimeoutExpired(cmd, timeout)
        procs[codes.index(None)].join(0.05)
    if failed:
        _stop(procs)
        return failed[0]
    return 0


def _stop(procs) -> None:
    procs = [p for p in procs if p.pid is not None]  # started
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    for p in procs:
        p.join(5)
        if p.exitcode is None:
            p.kill()
            p.join()


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()
