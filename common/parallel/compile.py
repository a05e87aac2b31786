"""Per-block torch.compile that keeps parameter names.

    compile_blocks(model.blocks)                    # inductor, dynamic=False, fullgraph if possible
    compile_blocks(model.blocks, mode="max-autotune")

Why per block: the blocks of a trunk are identical, so dynamo traces one graph and every other
block reuses it (compile time of one block, not of the model), and graph breaks or FSDP hooks
between blocks never split a block's graph. Why `forward` as an instance attribute rather than
`torch.compile(block)`: the latter returns an OptimizedModule that inserts `_orig_mod.` into
every parameter name; `nn.Module.compile()` keeps names but compiles `_call_impl`, i.e. also
the hooks FSDP2 registers later, which dynamo skips (a graph break, an error under fullgraph).
Compiling only `forward` keeps FQNs and leaves module hooks (FSDP2 all-gather/reshard) eager,
as torchtitan's compile-then-shard order does.

Order with activation checkpointing: apply_activation_checkpointing first, then compile_blocks
(the checkpoint is then traced, and inductor's partitioner decides what to recompute), then
fully_shard. Offload is the exception handled here: its saved-tensor hooks must run eagerly
(they copy tensors between devices), so for an offloaded block only the inner forward is
compiled and the hooks stay outside, where they still see what the compiled graph saves.
"""
from __future__ import annotations

import copy
import shutil
import warnings

import torch
from torch import nn

from common.parallel.activation_checkpoint import _CheckpointedForward, _OffloadedForward

DEFAULTS = {"fullgraph": None, "dynamic": False}  # None: fullgraph where possible (see below)


class _CompiledForward:
    """A block's compiled forward. Holds `inner` (the eager forward) so deepcopy can rebind the
    copy to its own block and recompile, instead of calling the original block's code.

    fullgraph=None ("where possible"): the first call compiles with fullgraph=True; if dynamo
    cannot capture the block in one graph (a graph break, a data-dependent branch) it warns with
    the reason and recompiles allowing graph breaks. An explicit fullgraph=True is strict.
    """

    def __init__(self, inner, options: dict):
        self.inner = inner
        self.options = options
        self._try_fullgraph = options.get("fullgraph") is None
        opts = {**options, "fullgraph": True} if self._try_fullgraph else options
        self.compiled = torch.compile(inner, **opts)

    def __call__(self, *args, **kwargs):
        if not self._try_fullgraph:
            return self.compiled(*args, **kwargs)
        try:
            out = self.compiled(*args, **kwargs)
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as e:
            reason = str(e).strip().splitlines()[0]
            warnings.warn(f"compile_blocks: block forward is not one graph ({reason}); compiling with "
                          "graph breaks. Pass fullgraph=True to make this an error.", stacklevel=2)
            relaxed = {**self.options, "fullgraph": False}
            if isinstance(self.inner, _CheckpointedForward):
                # Dynamo cannot trace a checkpoint whose body breaks (it would run the whole
                # block eagerly): keep the checkpoint eager around the compiled body instead.
                self.compiled = _CheckpointedForward(torch.compile(self.inner.inner, **relaxed),
                                                     self.inner.preserve_rng_state)
            else:
                self.compiled = torch.compile(self.inner, **relaxed)
            out = self.compiled(*args, **kwargs)
        self._try_fullgraph = False
        return out

    def __deepcopy__(self, memo):
        return _CompiledForward(copy.deepcopy(self.inner, memo), dict(self.options))


def _cpp_compiler() -> str | None:
    """The C++ compiler inductor's CPU backend would use, or None."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        return get_cpp_compiler()
    except (ImportError, AttributeError):  # private API moved: look on PATH like inductor does
        return next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
    except Exception:  # noqa: BLE001 - inductor raises InvalidCxxCompiler when none is found
        return None


def _is_compiled(block: nn.Module) -> bool:
    fwd = block.__dict__.get("forward")
    return isinstance(fwd, _CompiledForward) or (isinstance(fwd, _OffloadedForward)
                                                and isinstance(fwd.inner, _CompiledForward))


def compile_blocks(blocks: nn.ModuleList, **options) -> nn.ModuleList:
    """torch.compile each block's forward in place; `options` go to torch.compile (defaults:
    dynamic=False, fullgraph where possible, explicit fullgraph=True/False is honoured).
    Parameter names, state_dict keys and module types are unchanged. Raises RuntimeError when inductor would need a missing C++ compiler (CPU)."""
    options = {**DEFAULTS, **options}
    backend = options.get("backend", "inductor")
    on_cpu = any(p.device.type == "cpu" for p in blocks.parameters())
    if backend == "inductor" and on_cpu and _cpp_compiler() is None:
        raise RuntimeError("torch.compile on CPU (inductor's C++ backend) needs a C++ compiler and none was "
                           "found (g++; or set CXX). Install one (e.g. `apt-get install g++`) or disable "
                           "compilation (parallel.compile=false).")
    for i, block in enumerate(blocks):
        if _is_compiled(block):
            raise ValueError(f"block {i} ({type(block).__name__}) is already compiled")
        fwd = block.forward
        if isinstance(fwd, _OffloadedForward):
            fwd.inner = _CompiledForward(fwd.inner, options)
        else:
            block.forward = _CompiledForward(fwd, options)
    return blocks
