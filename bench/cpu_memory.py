"""CPU memory measurement for multi-rank benchmarks (bench/t2v_cp_memory.py): bytes saved for
backward inside vs outside the DiT blocks, peak step memory from a quiet start, and gloo
collectives that release their buffers before returning (reproducible peaks)."""
from __future__ import annotations

import gc
import time

import torch

from bench.activation_memory import peak_step_bytes
from common.parallel.activation_checkpoint import SavedTensorMeter


class SplitMeter(SavedTensorMeter):
    """SavedTensorMeter that also counts which bytes were saved while a DiT block was running
    (forward hooks on the blocks; under activation checkpointing the block inputs the wrapper
    reports are added from inside the block's forward, so they count as in-block too)."""

    def __init__(self, model):
        super().__init__(model)
        self.in_block_bytes = 0
        self._depth = 0
        self._handles = []
        for b in model.blocks:
            self._handles.append(b.register_forward_pre_hook(self._enter))
            self._handles.append(b.register_forward_hook(self._leave))

    def _enter(self, *_):
        self._depth += 1

    def _leave(self, *_):
        self._depth -= 1

    def add(self, t, *, offloaded: bool = False) -> None:
        before = self.device_bytes + self.host_bytes
        super().add(t, offloaded=offloaded)
        if self._depth:
            self.in_block_bytes += self.device_bytes + self.host_bytes - before

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def measured_peaks(step, reset, repeats: int) -> list[int]:
    """bench.activation_memory.peak_step_bytes of `repeats` steps, each from a quiet start.

    The profiler's running total counts the allocations made while it records, and their frees
    whenever they happen; two things would otherwise leak into it: a garbage collection during
    the step (it frees the previous case's model, whose gradients were allocated under an
    earlier profiler window: the total drops by their size), and communication buffers that the
    gloo worker thread releases late on a busy machine. So: collect garbage and keep the
    collector off during the step, and start every rank together after a barrier and a short
    pause (the worker threads finish with the previous step's buffers). The median is reported."""
    import torch.distributed as dist
    out = []
    for _ in range(repeats):
        reset()
        gc.collect()
        if dist.is_initialized():
            dist.barrier()
        time.sleep(0.05)
        gc.disable()
        try:
            out.append(peak_step_bytes(step, torch.device("cpu")))
        finally:
            gc.enable()
    return out


def prompt_comm_frees() -> None:
    """Make the blocking gloo collectives the CP code uses (all_to_all_single, all_gather) hand
    their buffers back before they return.

    ProcessGroupGloo runs a collective on a worker thread, whose Work object keeps references to
    the input/output tensors until that thread gets round to dropping it, after wait() returned.
    On a busy machine that is often later than the point where the caller dropped its own
    references, so buffers live on for a nondeterministic time (and are freed off the profiled
    thread): the measured peak then jitters by a few buffers. Here the collective runs with
    async_op=True on views of the caller's tensors, and after wait() the caller spins (at most
    1 s) until the storages' reference counts show the worker let go of those views. The memory
    this measures is then the program's own (as NCCL, whose buffers are the caller's, would see
    it); the values computed are unchanged."""
    import torch.distributed as dist
    if getattr(dist, "_t2v_cp_memory_patched", False):
        return
    use_count = torch._C._storage_Use_Count

    def _wait_released(tensors, expected):
        deadline = time.perf_counter() + 1.0
        while time.perf_counter() < deadline:
            if all(use_count(t.untyped_storage()._cdata) <= n for t, n in zip(tensors, expected)):
                return
            time.sleep(0)

    def _run(fn, owners, make_args, kwargs):
        # the views hold one storage reference each while alive; once both the caller's views and
        # the worker's references to them are gone, the counts are back to what they were before
        expected = [use_count(t.untyped_storage()._cdata) for t in owners]
        views = [t.view(t.shape) for t in owners]
        args = make_args(views)
        work = fn(*args, async_op=True, **kwargs)
        work.wait()
        del work, args, kwargs
        views.clear()
        _wait_released(owners, expected)

    a2a, all_gather = dist.all_to_all_single, dist.all_gather

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        if async_op:
            return a2a(output, input, output_split_sizes, input_split_sizes, group=group, async_op=True)
        _run(a2a, [output, input], lambda v: (v[0], v[1], output_split_sizes, input_split_sizes), {"group": group})

    def all_gather_(tensor_list, tensor, group=None, async_op=False):
        if async_op:
            return all_gather(tensor_list, tensor, group=group, async_op=True)
        _run(all_gather, list(tensor_list) + [tensor], lambda v: (v[:-1], v[-1]), {"group": group})
        # tensor_list's entries were written in place through the views

    dist.all_to_all_single, dist.all_gather = all_to_all_single, all_gather_
    dist._t2v_cp_memory_patched = True
