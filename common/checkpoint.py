"""Checkpoints that never lose work.

Layout under `<run.dir>/checkpoints/`:
  step_00000100/        a complete checkpoint: torch.distributed.checkpoint shards (model,
                        optimizer, EMA, frozen modules), rng_rank<r>.pt, meta.json (step, loader
                        state, model signature, resolved config)
  step_00000200.tmp/    being written (or died while being written): never picked, removed later
  latest                name of the newest complete checkpoint, replaced atomically

A checkpoint becomes visible only by the rename of its finished .tmp directory, after every rank
has written its part and meta.json is on disk, so a process killed mid-save leaves the previous
checkpoint as `latest`. DCP files are sharded per rank and resharded on load, so a checkpoint
written under one parallel layout loads under another.

Asynchronous saves (train.ckpt_async): the step blocks only while DCP stages a copy of the state
in CPU memory; a DCP thread writes it over a gloo group of its own (the training's collectives
keep the default group). DCP's coordinator (rank 0) finishes a save only after every rank
reported its write, so rank 0 then writes meta.json and renames, in a thread of its own. The next
save and the end of training wait for that; a kill before it leaves the previous checkpoint.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import threading
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from common import dist as mdist

_STEP_DIR = re.compile(r"^step_(\d{8})$")
META = "meta.json"


def _quiet_single_process(fn, *args, **kwargs):
    # DCP warns on every call without a process group; single-process save/load is intended here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, **kwargs)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used for this run; printed as one line."""


def _fsync_write(path: str, text: str) -> None:
    tmp = path + ".partial"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def is_complete(path: str) -> bool:
    return os.path.isdir(path) and _STEP_DIR.match(os.path.basename(path.rstrip("/"))) is not None \
        and os.path.isfile(os.path.join(path, META))


def list_complete(root: str) -> list[str]:
    if not os.path.isdir(root):
        return []
    found = [os.path.join(root, d) for d in os.listdir(root) if _STEP_DIR.match(d)]
    return sorted((p for p in found if is_complete(p)), key=lambda p: int(_STEP_DIR.match(os.path.basename(p)).group(1)))


def latest_complete(root: str) -> str | None:
    """The `latest` pointer if it names a complete checkpoint, else the highest complete step."""
    pointer = os.path.join(root, "latest")
    if os.path.isfile(pointer):
        with open(pointer) as f:
            candidate = os.path.join(root, f.read().strip())
        if is_complete(candidate):
            return candidate
    done = list_complete(root)
    return done[-1] if done else None


def read_meta(path: str) -> dict:
    with open(os.path.join(path, META)) as f:
        return json.load(f)


def resolve_checkpoint(path: str) -> str:
    """A complete checkpoint directory, or the newest one under a run dir / checkpoints dir."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    if is_complete(path):
        return path
    for root in (path, os.path.join(path, "checkpoints")):
        found = latest_complete(root)
        if found:
            return found
    raise CheckpointError(f"{path} is not a complete checkpoint and holds none (no {META}; interrupted save?)")


def check_signature(path: str, signature: dict[str, Any]) -> dict:
    """meta.json of `path`, after checking it was written for the model `signature` describes."""
    try:
        meta = read_meta(path)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable {META}: {e}") from None
    theirs = meta.get("signature", {})
    if theirs != signature:
        diff = sorted(k for k in set(theirs) | set(signature) if theirs.get(k) != signature.get(k))
        shown = ", ".join(f"{k}: checkpoint {theirs.get(k)!r} vs run {signature.get(k)!r}" for k in diff[:4])
        raise CheckpointError(f"checkpoint {path} was written for another model ({shown})")
    return meta


def _plain(state: dict) -> dict:
    """Tensor subclasses that only exist for a training recipe (torchao's fp8 all-gather weights)
    replaced by the plain tensors they wrap: a checkpoint must load anywhere."""
    if "torchao.float8" not in sys.modules:
        return state
    from common.precision.fp8 import plain_tensors
    return plain_tensors(state)


class CheckpointManager:
    """Save/resume of the whole training state; every rank calls every method."""

    def __init__(self, root: str, keep_last: int, signature: dict[str, Any], info: mdist.DistInfo,
                 async_save: bool = False, on_async_start: Callable[[int], None] | None = None):
        """on_async_start(step): called once an asynchronous save was handed to its writer thread."""
        self.root = root
        self.keep_last = max(1, keep_last)
        self.signature = signature
        self.info = info
        self.async_save = async_save
        self.on_async_start = on_async_start
        self._pending: _PendingSave | None = None
        self.last_write_s = 0.0  # start of the last save until its data was on disk (all ranks)
        self._pg = None
        if async_save and torch.distributed.is_initialized():
            # The writer thread's collectives must not interleave with the training's on one group.
            self._pg = torch.distributed.new_group(backend="gloo")
        elif async_save:  # DCP warns from its writer thread, where catch_warnings cannot reach
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        if info.is_main:
            os.makedirs(root, exist_ok=True)
        mdist.barrier()

    # ------------------------------------------------------------------ resolve
    def resolve(self, resume: str) -> str | None:
        if resume in ("none", "", "false", "no"):
            return None
        if resume == "auto":
            return latest_complete(self.root)
        return resolve_checkpoint(resume)

    def check_signature(self, path: str) -> dict:
        return check_signature(path, self.signature)

    # ------------------------------------------------------------------ save
    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             tensors: dict[str, dict[str, torch.Tensor]], meta: dict[str, Any]) -> str:
        """`tensors`: extra named tensor dicts (EMA, frozen modules) saved through DCP as well.
        Returns the checkpoint's final path (with async saves, complete only after wait())."""
        self.wait()
        t0 = time.perf_counter()
        name = f"step_{step:08d}"
        final = os.path.join(self.root, name)
        tmp = final + ".tmp"
        if self.info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        mdist.barrier()
        state = _plain({
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer),
            **tensors,
        })
        torch.save(mdist.rng_state(), os.path.join(tmp, f"rng_rank{self.info.rank}.pt"))
        full_meta = {"step": step, "signature": self.signature, "world_size": self.info.world_size,
                     "time": time.time(), **meta}
        if self.async_save:
            # DefaultStager copies every tensor (CPU ones too) before async_save returns, so the
            # next optimizer step cannot change what is being written.
            response = dcp.async_save(state, checkpoint_id=tmp, process_group=self._pg,
                                      no_dist=not torch.distributed.is_initialized())
            upload = getattr(response, "upload_completion", response)
            self._pending = _PendingSave(upload, lambda: self._finalize(tmp, final, name, full_meta), t0,
                                         self.info.is_main)
            if self.on_async_start is not None:
                self.on_async_start(step)
            return final
        _quiet_single_process(dcp.save, state, checkpoint_id=tmp)
        mdist.barrier()
        if self.info.is_main:
            self._finalize(tmp, final, name, full_meta)
        mdist.barrier()
        self.last_write_s = time.perf_counter() - t0
        return final

    def wait(self) -> None:
        """Block until the asynchronous save in flight (if any) is complete and visible."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.wait()
            self.last_write_s = pending.done_at - pending.started
            mdist.barrier()  # no rank reads `latest` or starts the next save before rank 0 renamed

    def _finalize(self, tmp: str, final: str, name: str, full_meta: dict) -> None:
        """Rank 0, once every rank's data is in `tmp`: meta.json, rename, latest, retention."""
        _fsync_write(os.path.join(tmp, META), json.dumps(full_meta, indent=1, default=str))
        if os.path.exists(final):  # re-saving a step after a resume: replace the older copy
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_write(os.path.join(self.root, "latest"), name + "\n")
        self._retain()

    def _retain(self) -> None:
        done = list_complete(self.root)
        for old in done[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        for d in os.listdir(self.root):  # leftovers of saves that died mid-way
            if d.endswith(".tmp"):
                shutil.rmtree(os.path.join(self.root, d), ignore_errors=True)

    # ------------------------------------------------------------------ load
    def load(self, path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             tensors: dict[str, dict[str, torch.Tensor]]) -> dict:
        meta = self.check_signature(path)
        state = _plain({
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer),
            **tensors,
        })
        try:
            _quiet_single_process(dcp.load, state, checkpoint_id=path)
        except Exception as e:
            raise CheckpointError(f"cannot load {path}: {str(e).splitlines()[0][:300]}") from None
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
        for key, sd in tensors.items():  # DCP loads in place; copy back where the dict held copies
            for name, t in state[key].items():
                if sd[name] is not t:
                    sd[name].copy_(t)
        rng_file = os.path.join(path, f"rng_rank{self.info.rank}.pt")
        if os.path.isfile(rng_file) and meta.get("world_size") == self.info.world_size:
            mdist.set_rng_state(torch.load(rng_file, weights_only=False))
        return meta


class _PendingSave:
    """An asynchronous save: DCP's upload future, then (rank 0) the finalize step in a thread."""

    def __init__(self, upload, finalize: Callable[[], None], started: float, is_main: bool):
        self.started, self.done_at = started, started
        self._error: BaseException | None = None
        self._upload, self._finalize = upload, finalize
        self._thread = threading.Thread(target=self._run, args=(is_main,), name="ckpt-finalize", daemon=True)
        self._thread.start()

    def _run(self, is_main: bool) -> None:
        try:
            self._upload.result()
            if is_main:
                self._finalize()
        except BaseException as e:  # re-raised in the training thread by wait()
            self._error = e
        self.done_at = time.perf_counter()

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise CheckpointError(f"asynchronous checkpoint save failed: {str(self._error).splitlines()[0][:300]}")


def load_model_weights(path: str, model: torch.nn.Module, tensors: dict[str, dict[str, torch.Tensor]] | None = None,
                       signature: dict | None = None) -> dict:
    """Inference-side load (single process): model weights plus named tensor dicts (EMA...)."""
    path = resolve_checkpoint(path)
    meta = check_signature(path, signature) if signature is not None else read_meta(path)
    state = {"model": get_model_state_dict(model, options=StateDictOptions()), **(tensors or {})}
    _quiet_single_process(dcp.load, state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    meta["path"] = path
    return meta


def load_for_inference(path: str, model: torch.nn.Module, frozen: dict[str, torch.nn.Module], signature: dict,
                       use_ema: bool = True) -> dict:
    """Single-process load for sampling/eval: the model's weights (then its EMA weights, when
    `use_ema` and the checkpoint holds them) and the frozen modules' state; eval mode."""
    ema = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    frozen_state = {name: dict(m.state_dict()) for name, m in frozen.items()}
    tensors = dict(frozen_state, **({"ema": ema} if use_ema else {}))
    meta = load_model_weights(path, model, tensors, signature=signature)
    for name, m in frozen.items():
        m.load_state_dict(frozen_state[name])
    if use_ema:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in ema:
                    p.copy_(ema[n])
    model.eval()
    return meta

