"""The tests' forked entrypoint runs (tests/forked_runs.py) behave as the processes they stand for:
argv, environment, working directory, output, exit status, torchrun's rank variables, a failing
rank stopping the job, a timeout, and nothing carried from one run to the next.

That a forked run trains exactly as a real one is checked where both meet: the real torchrun runs
of tests/test_launch.py and tests/test_fault_tolerance.py are compared with forked references."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests import forked_runs
from tests.conftest import ROOT, env, train_cmd

pytestmark = pytest.mark.skipif(not forked_runs.ENABLED, reason="FORKED_RUNS=0")

PROBE = "tests.forked_probe"


def probe(*args: str, nproc: int = 1, timeout: float = 60) -> subprocess.CompletedProcess:
    return forked_runs.run(train_cmd(nproc, PROBE) + list(args), env(), ROOT, timeout)


def test_commands_it_forks_and_those_it_leaves_to_subprocess():
    assert forked_runs.parse([sys.executable, "-m", "pkg.mod", "a", "b=1"]) == ("pkg.mod", ["a", "b=1"], 1)
    assert forked_runs.parse(train_cmd(4, "pkg.mod") + ["x"]) == ("pkg.mod", ["x"], 4)
    assert forked_runs.parse([sys.executable, "-c", "print(1)"]) is None
    assert forked_runs.parse(["bash", "launch/slurm.sh"]) is None
    restarts = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "--max-restarts=1", "-m", "pkg.mod"]
    assert forked_runs.parse(restarts) is None  # torchrun's own behaviour is under test


def test_one_process_gets_argv_cwd_output_and_exit_status():
    proc = probe("look", "x=1")
    assert proc.returncode == 0, proc.stderr
    assert f"argv=['look', 'x=1'] rank=- cwd={ROOT}" in proc.stdout
    assert "probe-err rank=-" in proc.stderr and "probe-err" not in proc.stdout
    failed = probe("raise")
    assert failed.returncode == 1
    assert "Traceback" in failed.stderr and "RuntimeError: probe failed" in failed.stderr


def test_data_loader_workers_are_the_runs_own_children():
    """As in a new process (not children of a forkserver nested in the fork, which would outlive
    a killed run)."""
    real = subprocess.run(train_cmd(1, PROBE) + ["loader-workers"], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=120)
    assert "workers_are_children=True" in real.stdout, real.stderr[-2000:]
    forked = probe("loader-workers", timeout=120)
    assert "workers_are_children=True" in forked.stdout, forked.stderr[-2000:]


def test_nothing_leaks_from_one_run_to_the_next():
    assert probe("leak").returncode == 0
    assert "leaked_env=False leaked_module=False" in probe("look").stdout


def test_ranks_get_torchrun_variables_and_a_failing_rank_stops_the_job():
    proc = probe("look", nproc=2)
    assert proc.returncode == 0, proc.stderr
    assert "rank=0" in proc.stdout and "rank=1" in proc.stdout
    t0 = time.monotonic()
    failed = probe("fail-rank1", nproc=2)
    assert failed.returncode == 3
    assert time.monotonic() - t0 < 30  # rank 0 (asleep for 600 s) was stopped


def test_a_store_port_taken_before_rank_0_binds_it_gets_a_new_port(monkeypatch):
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = [busy]  # what free_port hands out first: already in use
        real = forked_runs.free_port
        monkeypatch.setattr(forked_runs, "free_port", lambda: ports.pop() if ports else real())
        proc = probe("rendezvous", nproc=2)
    assert proc.returncode == 0, proc.stderr
    assert not ports and f"port={busy}" not in proc.stdout and proc.stdout.count("port=") == 2


def test_timeout_stops_the_run():
    with pytest.raises(subprocess.TimeoutExpired):
        probe("sleep", timeout=2)


def test_a_forkserver_started_by_someone_else_is_reported():
    # Then neither the warm preload nor the server's environment is ours: runs would start cold
    # without a word. A new interpreter, so that this worker's own server is not the one found.
    code = ("import os, warnings\n"
            "from multiprocessing import forkserver\n"
            "forkserver.ensure_running()\n"
            "from tests import forked_runs\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    forked_runs._mp_context(dict(os.environ))\n"
            "print(sum('already running' in str(w.message) for w in caught))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "1"
