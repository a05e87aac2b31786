"""Run a function on N gloo ranks in fresh processes and collect what each returns.

    results = run_ranks(fn, world_size=2, args=(...))   # fn(rank, world_size, *args) -> picklable

Ranks are forked from the tests' warm forkserver (tests/forked_runs.py: torch already imported,
nothing run yet), or spawned with FORKED_RUNS=0. Each rank gets OMP_NUM_THREADS=1 (several ranks share 2 cores) and an initialised gloo process
group; an exception in any rank fails the caller with that rank's traceback, and a hang is cut
off by `timeout` seconds instead of stalling CI.
"""
from __future__ import annotations

import os
import traceback

import torch.multiprocessing as mp

from tests import forked_runs


def _entry(rank, world_size, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        queue.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, args: tuple = (), timeout: float = 300.0) -> list:
    ctx = forked_runs.context() or mp.get_context("spawn")
    queue = ctx.Queue()
    port = forked_runs.free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    except Exception as e:  # queue.Empty on timeout
        errors.append(f"timed out after {timeout}s waiting for ranks ({type(e).__name__})")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
