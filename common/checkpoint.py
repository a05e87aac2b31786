"""Checkpoints that never lose work.

Layout under `<run.dir>/checkpoints/`:
  step_00000100/        a complete checkpoint: torch.distributed.checkpoint shards (model,
                        optimizer, EMA, frozen modules), rng_rank<r>.pt + rng_rank<r>.json (global
                        RNG states as tensors + JSON), meta.json (step, loader state, model
                        signature, resolved config, fingerprints of frozen folder weights)
  step_00000200.tmp/    being written (or died while being written): never picked, removed later
  step_00000100.old/    the copy a re-save of step 100 replaces; put back by the next start if the
                        re-save died before its rename
  latest                name of the newest complete checkpoint, replaced atomically

A checkpoint becomes visible only by the rename of its finished .tmp directory, after every rank
has written its part and meta.json is on disk, so a process killed mid-save leaves the previous
checkpoint as `latest`. Files and directories are fsynced before each rename that publishes
them. DCP files are sharded per rank and resharded on load, so a checkpoint written under one
parallel layout loads under another.

Trust: RNG state is loaded with torch.load(weights_only=True) and meta.json is JSON, but DCP's
.metadata file is a pickle: load only checkpoints from places you trust. Checkpoints written
before RNG state became tensors + JSON hold a pickled rng_rank<r>.pt, never unpickled on resume:
resuming from one under its own world size (where the RNG state is restored) is refused with one
line until `python -m common.checkpoint convert-rng PATH`, run by someone who trusts PATH,
rewrote it; under another world size it resumes as before (RNG state is not restored there).

Retention (train.keep_last = K): after each save, of the checkpoints at or below the step just
written, the K highest stay. Checkpoints above it are from a timeline given up by resuming from
an older step (or by a fresh start in a used run dir): they stay while the new run is behind
them (a resume from the wrong checkpoint can still go back) and are removed once the new run
passes them, or replaced when it re-saves their step, so that no step order ever mixes two
timelines. The checkpoint just written and the one `latest` names are never removed.

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
from common.durable import fsync_dir, write_text_durably
from common.faults import in_sync_save, slow_save

_STEP_DIR = re.compile(r"^step_(\d{8})$")
_OLD_DIR = re.compile(r"^(step_\d{8})\.old$")
META = "meta.json"


def _quiet_single_process(fn, *args, **kwargs):
    # DCP warns on every call without a process group; single-process save/load is intended here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, **kwargs)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used for this run; printed as one line."""


def _step_of(path: str) -> int:
    return int(_STEP_DIR.match(os.path.basename(path.rstrip("/"))).group(1))


def _rng_files(path: str, rank: int) -> tuple[str, str]:
    return os.path.join(path, f"rng_rank{rank}.pt"), os.path.join(path, f"rng_rank{rank}.json")


def _write_rng(path: str, rank: int, tensors: dict[str, torch.Tensor], info: dict) -> None:
    pt, js = _rng_files(path, rank)
    with open(pt, "wb") as f:
        torch.save(tensors, f)
        f.flush()
        os.fsync(f.fileno())
    write_text_durably(js, json.dumps(info))


def _read_rng(path: str, rank: int) -> tuple[dict[str, torch.Tensor], dict] | None:
    """This rank's RNG state in `path`, never unpickled: None if the checkpoint holds none."""
    pt, js = _rng_files(path, rank)
    if not os.path.isfile(pt):
        return None
    if not os.path.isfile(js):
        raise CheckpointError(
            f"{pt} holds RNG state in the old pickled format, which is not loaded because unpickling "
            f"can run code; if this checkpoint comes from a place you trust, convert it once with: "
            f"python -m common.checkpoint convert-rng {path}")
    try:
        tensors = torch.load(pt, map_location="cpu", weights_only=True)
        with open(js) as f:
            info = json.load(f)
    except Exception as e:
        raise CheckpointError(f"{path}: unreadable RNG state of rank {rank}: "
                              f"{(str(e).splitlines() or [type(e).__name__])[0][:300]}") from None
    return tensors, info


def convert_legacy_rng(path: str) -> int:
    """Rewrite the pickled rng_rank<r>.pt files of checkpoint `path` (written before RNG state
    became tensors + JSON) in the current format; returns how many were converted. Unpickles
    them: only for checkpoints from places you trust."""
    done = 0
    for name in sorted(os.listdir(path)):
        m = re.match(r"^rng_rank(\d+)\.pt$", name)
        if not m or os.path.isfile(_rng_files(path, int(m.group(1)))[1]):
            continue
        legacy = torch.load(os.path.join(path, name), map_location="cpu", weights_only=False)
        tensors, info = mdist.rng_state_from_legacy(legacy)
        partial = os.path.join(path, name + ".partial")
        with open(partial, "wb") as f:
            torch.save(tensors, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, os.path.join(path, name))
        write_text_durably(_rng_files(path, int(m.group(1)))[1], json.dumps(info))
        done += 1
    return done


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
        # Steps of checkpoints above the resumed (or first saved) step: see Retention above.
        self._abandoned: set[int] = set()
        if info.is_main:
            os.makedirs(root, exist_ok=True)
            self._recover_replaced()
        mdist.barrier()

    def _recover_replaced(self) -> None:
        """A re-save killed between its two renames left step_N.old and no complete step_N:
        the old copy is still the valid one. Otherwise the .old copy is a leftover."""
        for d in os.listdir(self.root):
            m = _OLD_DIR.match(d)
            if not m:
                continue
            old, final = os.path.join(self.root, d), os.path.join(self.root, m.group(1))
            if not is_complete(final) and os.path.isfile(os.path.join(old, META)):
                shutil.rmtree(final, ignore_errors=True)
                os.rename(old, final)
                fsync_dir(self.root)
            else:
                shutil.rmtree(old, ignore_errors=True)

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
        _write_rng(tmp, self.info.rank, *mdist.rng_state())
        full_meta = {"step": step, "signature": self.signature, "world_size": self.info.world_size,
                     "time": time.time(), **meta}
        if self.async_save:
            # DefaultStager copies every tensor (CPU ones too) before async_save returns, so the
            # next optimizer step cannot change what is being written.
            response = dcp.async_save(state, checkpoint_id=tmp, process_group=self._pg,
                                      no_dist=not torch.distributed.is_initialized())
            upload = getattr(response, "upload_completion", response)
            self._pending = _PendingSave(step, upload, lambda: self._finalize(tmp, final, name, full_meta), t0,
                                         self.info.is_main)
            if self.on_async_start is not None:
                self.on_async_start(step)
            return final
        _quiet_single_process(dcp.save, state, checkpoint_id=tmp)
        in_sync_save(step, self.info.rank, tmp)  # fault injection (tests): no-op unless MMP_FAULT_* is set
        mdist.barrier()
        if self.info.is_main:
            self._finalize(tmp, final, name, full_meta)
        mdist.barrier()
        self.last_write_s = time.perf_counter() - t0
        return final

    def wait(self) -> None:
        """Block until the asynchronous save in flight (if any) is complete and visible."""
        if self._pending is not None:
            self.wait_here()
            mdist.barrier()  # no rank reads `latest` or starts the next save before rank 0 renamed

    @property
    def pending_step(self) -> int | None:
        """The step of the asynchronous save still in flight, if any."""
        return self._pending.step if self._pending is not None else None

    def wait_here(self) -> None:
        """wait() without the barrier, for a rank that stops (Ctrl-C) while the others may be gone:
        each rank's writer ends on its own, and rank 0's renames the checkpoint once all are."""
        if self._pending is not None:
            try:
                self._pending.wait()  # a KeyboardInterrupt here leaves the save pending, still writing
            except CheckpointError:
                self._pending = None
                raise
            pending, self._pending = self._pending, None
            self.last_write_s = pending.done_at - pending.started

    def _finalize(self, tmp: str, final: str, name: str, full_meta: dict) -> None:
        """Rank 0, once every rank's data is in `tmp`: meta.json, rename, latest, retention."""
        slow_save()  # fault injection (tests): no-op unless MMP_FAULT_SLOW_SAVE_S is set
        # meta.json's fsync also syncs `tmp` itself: the entries of every rank's files.
        write_text_durably(os.path.join(tmp, META), json.dumps(full_meta, indent=1, default=str))
        if os.path.exists(final):
            # Re-saving a step (after a resume): the old copy goes aside first, so that at every
            # moment one complete copy exists (__init__ puts it back if we die in between).
            old = final + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            fsync_dir(self.root)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
            fsync_dir(self.root)
        write_text_durably(os.path.join(self.root, "latest"), name + "\n")
        self._retain(final)

    def _note_abandoned(self, step: int) -> None:
        self._abandoned.update(_step_of(p) for p in list_complete(self.root) if _step_of(p) > step)

    def _retain(self, written: str) -> None:
        """See Retention in the module docstring."""
        step = _step_of(written)
        self._note_abandoned(step)
        self._abandoned.discard(step)  # re-saved: this step is the new timeline's now
        keep = {os.path.realpath(written)}
        pointed = latest_complete(self.root)
        if pointed is not None:
            keep.add(os.path.realpath(pointed))
        current = []
        for p in list_complete(self.root):
            s = _step_of(p)
            if s in self._abandoned:
                if s < step and os.path.realpath(p) not in keep:  # passed by the new timeline
                    shutil.rmtree(p, ignore_errors=True)
                    self._abandoned.discard(s)
            elif s <= step:
                current.append(p)
        for old in current[: -self.keep_last]:
            if os.path.realpath(old) not in keep:
                shutil.rmtree(old, ignore_errors=True)
        for d in os.listdir(self.root):  # leftovers of saves that died mid-way
            if d.endswith(".tmp"):
                shutil.rmtree(os.path.join(self.root, d), ignore_errors=True)

    # ------------------------------------------------------------------ load
    def load(self, path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             tensors: dict[str, dict[str, torch.Tensor]]) -> dict:
        meta = self.check_signature(path)
        if self.info.is_main:  # what lies above the resumed step is another timeline
            self._note_abandoned(int(meta.get("step", 0)))
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
        if meta.get("world_size") == self.info.world_size:
            rng = _read_rng(path, self.info.rank)
            if rng is not None:
                try:
                    mdist.set_rng_state(*rng)
                except (KeyError, TypeError, ValueError, RuntimeError) as e:
                    raise CheckpointError(f"{path}: bad RNG state of rank {self.info.rank}: "
                                          f"{type(e).__name__}: {str(e)[:200]}") from None
        return meta


class _PendingSave:
    """An asynchronous save: DCP's upload future, then (rank 0) the finalize step in a thread."""

    def __init__(self, step: int, upload, finalize: Callable[[], None], started: float, is_main: bool):
        self.step = step
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
    `use_ema` and the checkpoint holds them) and the frozen modules' state (those loaded from a
    folder keep its weights, after their fingerprint was checked: common.frozen_weights); eval mode."""
    from common.frozen_weights import FrozenModules
    ema = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    modules = FrozenModules(frozen)
    frozen_state = modules.state()
    tensors = dict(frozen_state, **({"ema": ema} if use_ema else {}))
    meta = load_model_weights(path, model, tensors, signature=signature)
    modules.check(meta["path"], meta)
    for name, m in modules.saved.items():
        m.load_state_dict(frozen_state[name])
    if use_ema:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in ema:
                    p.copy_(ema[n])
    model.eval()
    return meta


def _main(argv: list[str] | None = None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m common.checkpoint",
                                description="checkpoint maintenance")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert-rng", help="rewrite the pickled RNG files of checkpoints written before "
                       "RNG state became tensors + JSON (unpickles them: trusted checkpoints only)")
    c.add_argument("path", help="a checkpoint directory, or a run / checkpoints dir (every checkpoint in it)")
    args = p.parse_args(argv)
    paths = [args.path] if is_complete(args.path) else (
        list_complete(args.path) or list_complete(os.path.join(args.path, "checkpoints")))
    if not paths:
        print(f"error: no complete checkpoint at {args.path}", file=sys.stderr)
        return 2
    for path in paths:
        print(f"{path}: converted {convert_legacy_rng(path)} RNG file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
