"""The training loop shared by every pipeline.

A pipeline hands over its parallelized model (common.parallel.ParallelModel), two functions
`prepare(batch) -> (inputs, target)` (everything without trainable weights: frozen encoders,
noise, timesteps) and `criterion(prediction, target) -> loss`, and a loader; the Trainer owns
gradient accumulation (or pipeline microbatches), clipping, AdamW, the LR schedule, EMA,
non-finite guards, checkpoints, resume, stopping on a scheduler's signal (a checkpoint of the
step in flight; common/stop_signals.py) and logging. The split lets pipeline parallelism feed
`inputs` to the first stage and `target` to the last.

Exactness: the LR is a pure function of the step, the loader's position is a global sample
count, and training noise is seeded per sample by the pipeline, so a resumed run repeats the
uninterrupted one bit for bit on CPU.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from typing import Any, Callable

import torch

from common import dist as mdist
from common.checkpoint import CheckpointManager, latest_complete
from common.config import to_yaml
from common.ema import EMA
from common.faults import CheckpointInterval, FaultInjector, HangWatchdog, StragglerMonitor, interval_message
from common.frozen_weights import FrozenModules
from common.metrics import ABANDONED, InputWait, MetricsLogger, StepProfiler, memory_stats, resolve_peak
from common.optim import build_optimizer, lr_at
from common.parallel.grads import clip_grads
from common.parallel.parallel_model import ParallelModel
from common.stop_signals import StopSignals, grace_message, grace_shortfall, parse_signals


def _agreed_signal(signals: StopSignals) -> signal.Signals | None:
    """The signal every rank reports (the highest number among those received; a collective)."""
    number = int(mdist.all_reduce_floats([int(signals.received or 0)], op="max")[0])
    return signal.Signals(number) if number else None


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. K non-finite steps in a row); printed as one line."""


class Trainer:
    def __init__(self, cfg, info: mdist.DistInfo, pm: ParallelModel,
                 prepare: Callable[[dict], tuple[tuple, Any]], criterion: Callable[[Any, Any], torch.Tensor],
                 loader, *, signature: dict[str, Any],
                 frozen: dict[str, torch.nn.Module] | None = None,
                 sample_fn: Callable[[torch.nn.Module, int], None] | None = None,
                 flops_fn: Callable[[tuple], float] | None = None,
                 after_optimizer_step: list[Callable[[], None]] | None = None):
        """flops_fn(inputs) -> forward FLOPs of one prepared micro-batch (its own shape and size:
        with buckets neither is fixed); None: no MFU. after_optimizer_step: called after each
        applied update (e.g. fp8 scales of the new weights for FSDP's float8 all-gather)."""
        self.cfg, self.info, self.pm = cfg, info, pm
        self.model = model = pm.module
        self.prepare, self.criterion = prepare, criterion
        self.loader, self.sample_fn = loader, sample_fn
        self.flops_fn = flops_fn
        self.after_optimizer_step = after_optimizer_step or []
        # FSDP casts parameters itself (MixedPrecisionPolicy); every other layout autocasts.
        from torch.distributed.fsdp import FSDPModule
        fsdp = any(isinstance(m, FSDPModule) for m in model.modules())
        self.autocast = lambda: info.precision.autocast(info.device, fsdp=fsdp)
        # Written to the run dir once the checkpoint signature check passed (fit), and into every
        # checkpoint: a mistaken relaunch with another model must not replace the run's config.
        self.config_yaml = to_yaml(cfg)
        self.frozen = FrozenModules(frozen)
        self.optimizer = build_optimizer(model, cfg.optim)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.ema = EMA(pm.plain, cfg.train.ema_decay, cfg.train.ema_warmup) if cfg.train.ema_decay > 0 else None
        self.faults = FaultInjector.from_env(cfg.run.dir, info.rank)  # None unless MMP_FAULT_* is set
        self.ckpt = CheckpointManager(os.path.join(cfg.run.dir, "checkpoints"), cfg.train.keep_last, signature, info,
                                      async_save=cfg.train.ckpt_async,
                                      on_async_start=self.faults.in_save if self.faults else None)
        self.step = 0
        self.skipped_steps = 0
        self.corrupt_total = 0
        self.samples_seen = 0  # global samples trained on (with buckets, steps differ in size)
        # This rank's rank-local time in the last step: waiting for the loader and preparing the
        # batches (straggler report, input_frac).
        self.fetch_s = self.prepare_s = 0.0

    # ------------------------------------------------------------------ state
    def _tensor_state(self) -> dict[str, dict[str, torch.Tensor]]:
        state = self.frozen.state()
        if self.ema is not None:
            state["ema"] = self.ema.state_dict()
        return state

    def save(self) -> str:
        meta = {"loader": self.loader.state_dict(), "skipped_steps": self.skipped_steps,
                "corrupt_total": self.corrupt_total, "samples_seen": self.samples_seen, "config": self.config_yaml,
                "frozen_folders": self.frozen.from_folders}
        return self.ckpt.save(self.step, self.model, self.optimizer, self._tensor_state(), meta)

    def resume(self) -> str | None:
        path = self.ckpt.resolve(self.cfg.run.resume)
        if path is None:
            latest = latest_complete(self.ckpt.root)
            if latest is not None:  # a fresh start must not mix two models' checkpoints in one run dir
                self.ckpt.check_signature(latest)
            return None
        # param_groups options come back from the checkpoint; foreach / fused belong to this layout.
        impl = [{k: g.get(k) for k in ("foreach", "fused")} for g in self.optimizer.param_groups]
        self.frozen.check(path, self.ckpt.check_signature(path))
        meta = self.ckpt.load(path, self.model, self.optimizer, self._tensor_state())
        for group, value in zip(self.optimizer.param_groups, impl):
            group.update(value)
        self.step = int(meta["step"])
        self.loader.load_state_dict(meta["loader"])
        self.skipped_steps = int(meta.get("skipped_steps", 0))
        self.corrupt_total = int(meta.get("corrupt_total", 0))
        self.samples_seen = int(meta.get("samples_seen", 0))
        return path

    # ------------------------------------------------------------------ loop
    def _sample(self) -> None:
        if self.sample_fn is None or not self.pm.can_sample:
            return
        ctx = self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext()
        with ctx:
            self.sample_fn(self.pm.plain, self.step)

    def _forward_backward(self, it) -> tuple[float, int, int, float]:
        """One optimizer step's gradients; returns (this rank's mean loss, corrupt samples read,
        samples trained, forward FLOPs of those samples)."""
        accum = self.cfg.train.grad_accum
        t0 = time.perf_counter()
        if self.faults is not None:
            self.faults.at_step(self.step + 1)
        batches = [next(it) for _ in range(accum)]
        if self.faults is not None:  # MMP_FAULT_RECORD_KEYS: which samples each step trains on
            self.faults.record_keys(self.step + 1, batches)
        self.fetch_s, self.prepare_s = time.perf_counter() - t0, 0.0
        corrupt = sum(int(b.get("__corrupt__", 0)) for b in batches)
        samples = sum(len(b["__position__"]) for b in batches)
        flops = 0.0
        if self.pm.pipeline is not None:
            # The pipeline splits the step's batch back into grad_accum microbatches.
            t0 = time.perf_counter()
            prepared = [self.prepare(b) for b in batches]
            self.prepare_s += time.perf_counter() - t0
            flops = sum(self.flops_fn(p[0]) for p in prepared) if self.flops_fn else 0.0
            inputs = tuple(torch.cat(parts) for parts in zip(*(p[0] for p in prepared)))
            target = torch.cat([p[1] for p in prepared])
            with self.autocast():
                loss = self.pm.pipeline.step(inputs, target)
            return (float(loss) if loss is not None else 0.0), corrupt, samples, flops
        loss_sum = None  # on the loss's device: a .cpu() per micro-batch would wait for its backward
        ddp = isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
        for micro, batch in enumerate(batches):
            t0 = time.perf_counter()
            inputs, target = self.prepare(batch)  # one micro-batch's inputs alive at a time
            self.prepare_s += time.perf_counter() - t0
            flops += self.flops_fn(inputs) if self.flops_fn else 0.0
            with self.model.no_sync() if ddp and micro < accum - 1 else contextlib.nullcontext():
                with self.autocast():
                    loss = self.criterion(self.model(*inputs), target)
                (loss / accum).backward()
            part = loss.detach().double()
            loss_sum = part if loss_sum is None else loss_sum + part
        return float(loss_sum.cpu() / accum), corrupt, samples, flops

    def fit(self) -> dict:
        cfg, tc = self.cfg, self.cfg.train
        resumed_from = self.resume()
        if self.info.is_main:
            with open(os.path.join(cfg.run.dir, "config.yaml"), "w") as f:
                f.write(self.config_yaml)
        log = MetricsLogger(cfg.run.dir, self.info.is_main, tc.steps, self.step, tc.progress and self.info.is_main)
        if resumed_from:
            log.event(event="resume", step=self.step, checkpoint=resumed_from, set_aside=log.set_aside)
            log.message(f"resumed from {resumed_from} at step {self.step}")
        if log.set_aside:
            log.message(f"{log.set_aside} metrics.jsonl line(s) of steps after {self.step}, which this run logs "
                        f"again, moved to {ABANDONED}")
        peak = resolve_peak(self.info.device, self.info.compute_dtype, tc.peak_flops) if self.flops_fn else None
        if peak is not None:
            log.event(event="peak", flops=peak.flops, source=peak.source, matmul_flops=peak.matmul_flops)
            log.message(f"MFU against {peak.flops / 1e12:.3g} TFLOP/s per rank ({peak.source})")
        clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        bad_in_row = 0
        window_t0, window_samples, window_flops = time.perf_counter(), 0, 0.0
        inputs_wait = InputWait(tc.input_warn_frac)
        profiler = StepProfiler((tc.profile_at, tc.profile_count) if tc.profile_at else None, cfg.run.dir,
                                self.info.rank, self.info.device)
        # Before the watchdog, so SIGTERM taken here is not also its stack dump's (common/faults.py),
        # and before the loader's workers fork, so they ignore these signals (common/stop_signals.py).
        signals = StopSignals(parse_signals(tc.save_on_signal))
        watchdog = HangWatchdog(tc.hang_timeout_s, cfg.run.dir, self.info.rank)
        stragglers = StragglerMonitor(tc.straggler_every, tc.straggler_factor, self.info.world_size)
        interval = CheckpointInterval(tc.ckpt_every, tc.mtbf_hours, start_step=self.step)
        stop_signal = None  # set when train.save_on_signal's signal stopped the run
        grace_warned = False
        try:
            it = iter(self.loader)
            window_t0 = time.perf_counter()  # the workers' start is not a step's time
            while self.step < tc.steps:
                watchdog.beat(f"step {self.step + 1}")
                step_t0 = time.perf_counter()
                profiler.before_step(self.step + 1)
                lr = lr_at(self.step, tc.steps, cfg.optim)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                step_loss, corrupt, samples, flops = self._forward_backward(it)
                # Every rank holding the loss (last pipeline stage) adds loss / (ranks per stage):
                # the sum is the mean over data-parallel groups (CP/TP ranks hold identical copies).
                # Counts are divided by the ranks reading the same samples, so their sums are global.
                share = step_loss / self.pm.ranks_per_stage if self.pm.holds_loss else 0.0
                replicas = self.info.world_size // self.pm.dp_size
                totals = mdist.all_reduce_floats([share, corrupt / replicas, samples / replicas, flops / replicas,
                                                  signals.flag])
                step_loss = float(totals[0])
                self.corrupt_total += round(float(totals[1]))
                for hook in self.pm.grad_hooks:
                    hook()
                if self.faults is not None:  # MMP_FAULT_NAN_*: a non-finite loss or gradient on request
                    step_loss = self.faults.corrupt_step(self.step + 1, step_loss, self.params)
                grad_norm = clip_grads(self.params, clip, self.pm.ranks_per_stage)
                if math.isfinite(step_loss) and math.isfinite(grad_norm):
                    self.optimizer.step()
                    for hook in self.after_optimizer_step:
                        hook()
                    if self.ema is not None:
                        self.ema.update(self.step)
                    bad_in_row = 0
                else:
                    self.skipped_steps += 1
                    bad_in_row += 1
                    log.message(f"step {self.step + 1}: non-finite loss ({step_loss}) or grad norm ({grad_norm}); step skipped")
                    if bad_in_row >= tc.max_bad_steps:
                        raise TrainingError(f"{bad_in_row} non-finite steps in a row (train.max_bad_steps={tc.max_bad_steps}) "
                                            f"at step {self.step + 1}; lower optim.lr or check the data")
                self.optimizer.zero_grad(set_to_none=True)
                self.step += 1
                step_samples, step_flops = round(float(totals[2])), float(totals[3])
                self.samples_seen += step_samples
                window_samples += step_samples
                window_flops += step_flops
                inputs_wait.add(self.fetch_s, self.prepare_s)
                profiled = profiler.after_step(self.step)
                export_s = profiled["write_s"] if profiled is not None else 0.0
                if profiled is not None:
                    window_t0 += export_s  # writing the trace is not a step's time
                    log.event(**profiled)
                    log.message(f"profile of steps {profiled['steps'][0]}-{profiled['steps'][1]}: {profiled['table']}")
                log.advance()
                interval.add_step_time(self.step, time.perf_counter() - step_t0 - export_s)
                stragglers.add(self.fetch_s + self.prepare_s)
                report = stragglers.end_step(self.step)
                if report is not None and report.slow:
                    log.message(report.message())
                    log.event(**report.event())
                if self.step % tc.log_every == 0 or self.step == tc.steps:
                    elapsed = time.perf_counter() - window_t0
                    sps = window_samples / max(elapsed, 1e-9)
                    wait_fields, wait_event, wait_message = inputs_wait.end_window(elapsed, self.step,
                                                                                   cfg.data.num_workers)
                    scalars = {"loss": step_loss, "lr": lr, "grad_norm": grad_norm, "samples_per_s": sps,
                               "samples_seen": self.samples_seen, "skipped_steps": self.skipped_steps,
                               "corrupt_samples": self.corrupt_total, **wait_fields,
                               "epoch": getattr(self.loader, "epoch", 0), **memory_stats(self.info.device)}
                    if self.flops_fn:  # training ~ 3x the forward FLOPs
                        scalars["step_flops"] = 3.0 * step_flops
                    if peak is not None:
                        achieved = 3.0 * window_flops / max(elapsed, 1e-9) / self.info.world_size
                        scalars["mfu"] = achieved / peak.flops
                        if peak.matmul_flops and peak.matmul_flops != peak.flops:
                            scalars["mfu_matmul"] = achieved / peak.matmul_flops
                    log.log(self.step, scalars)
                    if wait_event is not None:
                        log.message(wait_message)
                        log.event(**wait_event)
                    window_t0, window_samples, window_flops = time.perf_counter(), 0, 0.0
                if tc.stop_after and self.step == tc.stop_after:
                    log.message(f"stopping after step {self.step} (train.stop_after), as if killed")
                    log.close()
                    mdist.barrier()
                    os._exit(0)  # no final checkpoint, no cleanup: exactly what a kill leaves behind
                if totals[4] > 0 and self.step < tc.steps:  # every rank sees the same sum, at the same step
                    stop_signal = _agreed_signal(signals)
                    log.message(f"{stop_signal.name} received by {round(totals[4])} rank(s): saving a checkpoint "
                                f"at step {self.step}, then stopping (train.save_on_signal)")
                if interval.due(self.step) or self.step == tc.steps or stop_signal is not None:
                    watchdog.beat(f"checkpoint at step {self.step}")
                    t0 = time.perf_counter()
                    path = self.save()
                    blocked = time.perf_counter() - t0
                    log.message(f"checkpoint {path} (step blocked {blocked:.3g} s"
                                + (", written in the background)" if tc.ckpt_async else ")"))
                    log.event(event="checkpoint", step=self.step, blocked_s=blocked, is_async=tc.ckpt_async)
                    change = interval.after_save(self.step, blocked, self.ckpt.last_write_s)
                    if change is not None:
                        log.message(interval_message(change))
                        log.event(**change)
                    if signals.taken and not grace_warned and interval.mean_step_s is not None:
                        # last_write_s: this save's (synchronous) or the one before (asynchronous)
                        shortfall = grace_shortfall(interval.mean_step_s, self.ckpt.last_write_s,
                                                    tc.signal_grace_s)
                        if shortfall is not None:
                            grace_warned = True
                            log.message(grace_message(shortfall))
                            log.event(step=self.step, **shortfall)
                if stop_signal is not None:
                    log.event(event="stopped", step=self.step, signal=stop_signal.name)
                    break
                if (tc.sample_every and self.step % tc.sample_every == 0) or self.step == tc.steps:
                    watchdog.beat(f"sampling at step {self.step}")
                    self._sample()
                if window_samples == 0:  # samples/s measures training steps, not saves or sampling
                    window_t0 = time.perf_counter()
            watchdog.beat("the last checkpoint's write")
            self.ckpt.wait()
            if stop_signal is not None:  # every rank: the one(s) the signal reached know when it came
                after = mdist.all_reduce_floats([signals.seconds_since() or 0.0], op="max")[0]
                log.message(f"checkpoint of step {self.step} complete {after:.3g} s after {stop_signal.name} "
                            f"(train.signal_grace_s={tc.signal_grace_s:g})")
                log.event(event="saved_on_signal", step=self.step, signal=stop_signal.name,
                          after_signal_s=round(after, 3))
            if stop_signal is None:
                # A signal during the last step's save or samples: the run is complete, but a staged
                # run (vlm) must not start its next stage, and every rank has to agree on that.
                stop_signal = _agreed_signal(signals)
        finally:
            profiler.close()
            watchdog.close()
            signals.close()
            log.close()
        return {"step": self.step, "skipped_steps": self.skipped_steps, "corrupt_samples": self.corrupt_total,
                "stop_signal": stop_signal}
