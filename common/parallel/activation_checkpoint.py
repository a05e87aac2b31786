"""Activation checkpointing for a stack of blocks: none / full / selective (every k-th) / offload.

    apply_activation_checkpointing(model.blocks, "selective", every=2)

Each block is changed in place by replacing its `forward` with a wrapper stored as an instance
attribute. Why not torch's `checkpoint_wrapper`: it inserts a `_checkpoint_wrapped_module`
level, so `state_dict()` keys survive (a post-hook strips the prefix) but `named_parameters()`
(EMA, optimizer groups, weight-decay filters, our FQN-keyed checkpoints) do not. An instance
`forward` adds no submodule, so every FQN is unchanged, `type(block)` is unchanged, and
`nn.Module.__call__` still runs any hooks around it; FSDP2's `fully_shard(block)`, applied
afterwards, registers its all-gather / reshard hooks there, i.e. outside the checkpointed region,
which is the order torchtitan uses (AC, then compile, then FSDP).

Recommended order: apply_activation_checkpointing -> compile_blocks -> fully_shard per block.

Modes:
  none       nothing changes.
  full       every block's forward runs under non-reentrant `torch.utils.checkpoint`: only the
             block inputs are kept, everything inside is recomputed in backward.
  selective  the same for blocks 0, k, 2k, ... (k = `every`); the others keep their activations.
  offload    activations saved for backward are copied to pinned host memory in forward and back
             to the device in backward (CUDA). Parameters are never copied (they are alive anyway;
             under FSDP2 a host copy of the unsharded weights would defeat resharding). Tensors
             already on the CPU are kept as they are, so on a CPU-only run the mode runs its hooks
             but moves nothing.

`SavedTensorMeter` measures what a forward pass holds for backward (tests and bench use it).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

MODES = ("none", "full", "selective", "offload")

# The meter active in this process (at most one); the wrappers report to it what they keep.
_METER: "SavedTensorMeter | None" = None


def _storage_key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (t.device, s.data_ptr())


def _param_keys(module: nn.Module) -> set:
    # FSDP2's sharded parameters are DTensors; their local shard holds the storage.
    return {_storage_key(p.to_local() if hasattr(p, "to_local") else p) for p in module.parameters()}


class SavedTensorMeter:
    """Context manager counting the bytes a forward pass holds for backward.

    Every tensor autograd saves is counted once per distinct storage (a view and its base, or
    one tensor saved by two ops, hold one buffer), parameters excluded (they live regardless).
    Tensors saved inside a checkpointed block are not held, so they are not seen; the block
    inputs that checkpoint keeps for the recompute are reported by the wrapper and counted.
    Offloaded activations are counted in `host_bytes` rather than `device_bytes`.

        with SavedTensorMeter(model) as m:
            loss = model(...).sum()
        m.device_bytes, m.host_bytes
    """

    def __init__(self, model: nn.Module | None = None):
        self._params = _param_keys(model) if model is not None else set()
        self._seen: set = set()
        self.device_bytes = 0
        self.host_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def add(self, t: torch.Tensor, *, offloaded: bool = False) -> None:
        if isinstance(t, nn.Parameter) or not isinstance(t, torch.Tensor):
            return
        key = _storage_key(t)
        if key in self._params or key in self._seen:
            return
        self._seen.add(key)
        n = t.untyped_storage().nbytes()
        if offloaded:
            self.host_bytes += n
        else:
            self.device_bytes += n

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t

    def __enter__(self) -> "SavedTensorMeter":
        global _METER
        if _METER is not None:
            raise RuntimeError("a SavedTensorMeter is already active")
        _METER = self
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        global _METER
        self._hooks.__exit__(*exc)
        _METER = None


def _metering() -> "SavedTensorMeter | None":
    # Under torch.compile the meter's Python bookkeeping would break the graph; skip it there.
    if _METER is None or torch.compiler.is_compiling():
        return None
    return _METER


class _CheckpointedForward:
    """Runs the wrapped forward under non-reentrant checkpoint while autograd records.

    Non-reentrant: it supports keyword arguments and inputs that do not require grad (t0, the
    text context, RoPE tables), nests with other saved-tensor hooks and is what torch.compile
    traces as a higher-order op. A plain object holding `inner` (the bound method) rather than
    a closure, so `copy.deepcopy(model)` rebinds it to the copy instead of the original.
    """

    def __init__(self, inner, preserve_rng_state: bool):
        self.inner = inner
        self.preserve_rng_state = preserve_rng_state

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():  # eval / sampling: nothing to save, nothing to recompute
            return self.inner(*args, **kwargs)
        meter = _metering()
        if meter is not None:  # checkpoint holds its inputs until the recompute
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    meter.add(t)
        return checkpoint(self.inner, *args, use_reentrant=False,
                          preserve_rng_state=self.preserve_rng_state, **kwargs)


class _OffloadedForward:
    """Runs the wrapped forward with saved-tensor hooks that move activations to host memory."""

    def __init__(self, module: nn.Module, inner):
        self.module = module
        self.inner = inner

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)
        # Parameters as seen now: under FSDP2 these are the unsharded ones its pre-forward hook
        # installed, which are what the ops inside save.
        params = _param_keys(self.module)
        meter = _metering()

        def pack(t: torch.Tensor):
            if t.device.type == "cpu" or _storage_key(t) in params or isinstance(t, nn.Parameter):
                if meter is not None:
                    meter.add(t)
                return t
            if meter is not None:
                meter.add(t, offloaded=True)
            # CUDA: pinned destination, so the device-to-host copy is asynchronous on the current
            # stream; the host-to-device copy in unpack is ordered after it on the same stream,
            # and the pinned allocator keeps the buffer until copies that use it are done.
            pin = t.device.type == "cuda"
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            return (t.device, host)

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return host.to(device, non_blocking=host.is_pinned())

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return self.inner(*args, **kwargs)


def _wrapped(block: nn.Module):
    fwd = block.__dict__.get("forward")
    return fwd if isinstance(fwd, (_CheckpointedForward, _OffloadedForward)) else None


def apply_activation_checkpointing(blocks: nn.ModuleList, mode: str, every: int = 1, *,
                                   preserve_rng_state: bool = True) -> nn.ModuleList:
    """Apply activation checkpointing `mode` to `blocks` in place and return them.

    every: for "selective", checkpoint blocks whose index is a multiple of `every` (every=1 is
    "full"); ignored by the other modes but must still be >= 1.
    preserve_rng_state: restore the RNG before the recompute so dropout masks match; blocks with
    no randomness (DiT blocks) may pass False to skip saving the RNG state per block.
    """
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r} is not one of {', '.join(MODES)}")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"activation checkpointing every={every!r}: must be an integer >= 1 "
                         "(checkpoint every k-th block)")
    if mode == "none":
        return blocks
    for i, block in enumerate(blocks):
        if _wrapped(block) is not None:
            raise ValueError(f"block {i} ({type(block).__name__}) already has activation checkpointing applied")
        if mode == "full" or (mode == "selective" and i % every == 0):
            block.forward = _CheckpointedForward(block.forward, preserve_rng_state)
        elif mode == "offload":
            block.forward = _OffloadedForward(block, block.forward)
    return blocks
