"""The shared entrypoints every pipeline hands its spec (common/pipeline.py) to.

  train(spec)    process group, seeding, device moves, parallelize, the loader, the in-training
                 sample hook, the Trainer and teardown
  sample(spec)   prompts -> one file set per sample, index.jsonl and a grid, from a run's checkpoint
  evaluate(...)  held-out prompts -> generated media -> a pipeline's analyser -> eval.json
  write_eval     a result dict -> RUN/eval.json (eval_step_N.json for an explicit checkpoint)
  load_run(spec) a run directory -> (components, checkpoint meta), weights loaded (EMA if any)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch

from common import dist as mdist
from common.checkpoint import CheckpointError, latest_complete, load_for_inference
from common.cli import add_checkpoint_arg
from common.config import ConfigError, from_yaml_file, parse_cli
from common.data import StreamingLoader
from common.data.captions import first_examples
from common.durable import write_text_durably
from common.host_memory import apply_host_malloc
from common.pipeline import PipelineSpec
from common.trainer import Trainer


def prog(spec: PipelineSpec, command: str) -> str:
    return f"python -m pipelines.{spec.name}.{command}"


# --------------------------------------------------------------------------- train
def train(spec: PipelineSpec, argv=None, cfg=None) -> int:
    """argv: the command line; or cfg, an already parsed and validated config (staged runs)."""
    if cfg is None:
        cfg = parse_cli(spec.config, argv, prog(spec, "train"), spec.description)
    info = mdist.init_distributed(precision=cfg.precision)
    apply_host_malloc(cfg.train.host_malloc, info.device.type)  # before the first large allocation
    mdist.seed_everything(cfg.run.seed, info.rank)
    torch.use_deterministic_algorithms(True, warn_only=True)
    # Deterministic algorithms, but no NaN fill of every torch.empty that the flag above turns on:
    # a debugging aid that results do not depend on (MMP_KERNEL_POISON covers our kernels' outputs)
    # and that cost a fill kernel per allocation, 2,600 of the 5,600 kernels of an eager DiT-B step
    # on an H200 (2026-12-04 profile).
    torch.utils.deterministic.fill_uninitialized_memory = False
    comp = spec.build(cfg)
    if spec.init is not None:
        spec.init(comp)
    comp.to(info.device)
    prepare, criterion = spec.step_fns(comp, info.device)
    n_params = sum(p.numel() for p in comp.model.parameters())  # before sharding: the whole model
    lowp = convert_low_precision(spec, comp, cfg, info, prepare)  # before sharding: FSDP gathers fp8 weights
    pm = spec.parallelize(comp.model, cfg.parallel, info, microbatches=cfg.train.grad_accum, criterion=criterion,
                          name=spec.name)
    if lowp.fp8_all_gather:
        from common.precision.fp8 import fp8_all_gather_over_gloo
        fp8_all_gather_over_gloo(pm.plain)  # a no-op unless the process group is gloo
    loader = make_loader(spec, comp, cfg, dp_rank=pm.dp_rank, dp_size=pm.dp_size)
    # Sample grids show the first held-out captions (e.g. compositions never seen in training).
    prompts = [c for c, _ in first_examples(cfg.data.eval_shards, cfg.sample.num)] \
        if cfg.data.eval_shards and cfg.sample.num and spec.sample_hook is None else []
    if info.is_main:
        name = f"{cfg.run.name}: " if cfg.run.name else ""  # run.name leads the start line (logs, job lists)
        print(f"{name}{spec.name}: {spec.describe(comp)}, {n_params / 1e6:.2f}M params, {loader.num_samples} training "
              f"samples, world size {info.world_size} [{pm.dims.describe}], device {info.device}, "
              f"{info.precision.describe()}", flush=True)
        if lowp.report is not None:
            print(lowp.report.summary() + lowp.note, flush=True)

    def sample_fn(model_for_sampling, step: int) -> None:
        if spec.sample_hook is not None:
            spec.sample_hook(comp, model_for_sampling, step, info)
            return
        if not prompts:
            return
        seeds = [cfg.sample.seed + i for i in range(len(prompts))]
        media = spec.generate(comp, model_for_sampling, prompts, seeds, steps=cfg.sample.steps,
                              guidance=cfg.sample.cfg, device=info.device)
        if info.is_main:
            stem = os.path.join(cfg.run.dir, "samples", f"step_{step:08d}")
            os.makedirs(os.path.dirname(stem), exist_ok=True)
            spec.write_grid(media, stem, comp, {})
            with open(stem + ".txt", "w") as f:
                f.write("\n".join(prompts) + "\n")

    flops_fn = (lambda inputs: spec.flops(comp, inputs)) if spec.flops else None
    trainer = Trainer(cfg, info, pm, prepare, criterion, loader, signature=spec.signature(comp),
                      frozen=comp.frozen, sample_fn=sample_fn, flops_fn=flops_fn,
                      after_optimizer_step=lowp.after_optimizer_step)
    try:
        summary = trainer.fit()
    except KeyboardInterrupt:
        # Ctrl-C: stop at once (train.save_on_signal=SIGINT,... would save the step in flight first),
        # but let an asynchronous save already written in the background become a checkpoint.
        _finish_save_after_interrupt(trainer.ckpt, info.is_main)
        latest = latest_complete(os.path.join(cfg.run.dir, "checkpoints"))
        if info.is_main:
            where = f"the latest checkpoint is {latest}" if latest else "no checkpoint was completed yet"
            print(f"\ninterrupted at step {trainer.step}: {where}; the same command resumes from it", file=sys.stderr,
                  flush=True)
        return 130  # as a shell reports a process SIGINT ended
    stop_signal = summary["stop_signal"]
    if info.is_main:
        complete = summary["step"] >= cfg.train.steps
        head = "done:" if complete else f"stopped by {stop_signal.name} at"
        print(f"{head} step {summary['step']}, skipped steps {summary['skipped_steps']}, "
              f"corrupt samples {summary['corrupt_samples']}; run dir {cfg.run.dir}", flush=True)
        if stop_signal and complete:
            print(f"{stop_signal.name} came as the run ended: exiting with {128 + stop_signal}, so that no later "
                  "stage starts", flush=True)
        elif stop_signal:
            print(f"checkpoint saved at step {summary['step']}: the same command resumes from it", flush=True)
    mdist.teardown()
    return 128 + stop_signal if stop_signal else 0  # as a shell reports a process the signal ended


def _finish_save_after_interrupt(ckpt, is_main: bool) -> None:
    """After Ctrl-C: wait for the asynchronous save in flight (its writer is a daemon thread the
    exit would cut off); a second Ctrl-C abandons it, and the checkpoint before stays `latest`."""
    step = ckpt.pending_step
    if step is None:
        return
    if is_main:
        print(f"\ninterrupted: waiting for the checkpoint of step {step}, still being written "
              "(Ctrl-C again abandons it)", file=sys.stderr, flush=True)
    try:
        ckpt.wait_here()
    except KeyboardInterrupt:
        pass
    except CheckpointError as e:
        if is_main:
            print(f"warning: {e}", file=sys.stderr, flush=True)


def make_loader(spec: PipelineSpec, comp, cfg, *, dp_rank: int, dp_size: int) -> StreamingLoader:
    """The training loader of data-parallel rank `dp_rank` of `dp_size`."""
    return StreamingLoader.from_config(cfg.data, spec.decoder(comp), dp_rank=dp_rank, dp_size=dp_size,
                                       seed=cfg.run.seed,
                                       tokens=spec.bucket_tokens(comp) if spec.bucket_tokens else None,
                                       collate=spec.collate(comp) if spec.collate else None)


@dataclass
class LowPrecision:
    report: object = None  # common.precision.convert.LowPrecisionReport
    after_optimizer_step: list = field(default_factory=list)
    fp8_all_gather: bool = False
    note: str = ""


def convert_low_precision(spec: PipelineSpec, comp, cfg, info, prepare) -> LowPrecision:
    """precision.fp8 / precision.int8: swap the model's linears before parallelizing. Which ones is
    decided per layer from the rows (tokens) each linear sees in one probe forward of a first
    micro-batch, its K and N, and the roofline of precision.roofline's device."""
    pc = cfg.precision
    if pc.fp8 == "none" and not pc.int8:
        return LowPrecision()
    from common.parallel.dims import ParallelDims
    from common.precision.convert import record_linear_rows
    from common.precision.hardware import DEVICES
    inputs, _ = prepare(next(iter(make_loader(spec, comp, cfg, dp_rank=0, dp_size=1))))
    rows = record_linear_rows(comp.model, lambda: comp.model(*inputs))
    exclude = () if pc.convert == "all" else tuple(
        name for name, m in comp.model.named_modules()
        if isinstance(m, torch.nn.Linear) and not re.search(r"(^|\.)blocks\.\d+\.", name))
    force = pc.roofline == "none"
    device_spec = DEVICES.get(pc.roofline)  # auto: the model's GPU if known, else H100 SXM
    if pc.int8:
        from common.precision.int8 import convert_int8
        return LowPrecision(convert_int8(comp.model, rows=rows, spec=device_spec, force=force, exclude=exclude))
    from common.precision.fp8 import convert_fp8, fp8_after_optimizer_step
    dims = ParallelDims.from_config(cfg.parallel, info.world_size)
    all_gather = pc.fp8 == "tensorwise" and pc.fp8_all_gather and dims.dp_mode == "fsdp" and info.world_size > 1
    # torch._scaled_mm's CPU path for e4m3 x e4m3 with scalar scales runs at ~0.07 GFLOP/s (minutes
    # per tiny step); emulation rounds the operands to fp8 the same way and multiplies in fp32.
    emulate = info.device.type == "cpu"
    report = convert_fp8(comp.model, pc.fp8, rows=rows, spec=device_spec, fsdp_all_gather=all_gather, force=force,
                         emulate=emulate, exclude=exclude)
    return LowPrecision(report, [lambda: fp8_after_optimizer_step(comp.model)] if all_gather else [], all_gather,
                        " (fp8 GEMMs emulated on CPU)" if emulate else "")


# --------------------------------------------------------------------------- inference
def check_run_dir(run_dir: str) -> str:
    """The run's config.yaml; CheckpointError if `run_dir` is not a run directory."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        raise CheckpointError(f"{run_dir} is not a run directory (no config.yaml)")
    return path


def load_run(spec: PipelineSpec, run_dir: str, checkpoint: str | None = None, use_ema: bool = True):
    """(components, meta) with the checkpoint's weights (EMA if present) loaded; single process, eval mode."""
    cfg = from_yaml_file(spec.config, check_run_dir(run_dir))
    comp = spec.build(cfg)
    meta = load_for_inference(checkpoint or os.path.join(run_dir, "checkpoints"), comp.model, comp.frozen,
                              spec.signature(comp), use_ema=use_ema and cfg.train.ema_decay > 0)
    return comp, meta


def read_prompts(args) -> list[str]:
    """--prompt, or the non-empty lines of --prompts."""
    if args.prompt:
        return [args.prompt]
    if not os.path.isfile(args.prompts):
        raise ConfigError(f"--prompts file not found: {args.prompts}")
    with open(args.prompts) as f:
        prompts = [line.strip() for line in f if line.strip()]
    if not prompts:
        raise ConfigError(f"--prompts file {args.prompts} has no prompts")
    return prompts


def _add_generation_args(p: argparse.ArgumentParser, noun: str) -> None:
    p.add_argument("--steps", type=int, default=None, help="sampler steps (default: the run's sample.steps)")
    p.add_argument("--cfg", type=float, default=None, help="guidance weight (default: the run's sample.cfg)")
    p.add_argument("--seed", type=int, default=0, help=f"seed of the first {noun}; {noun} i uses seed + i")


def add_word_probe_args(p: argparse.ArgumentParser, words: str, data: str) -> None:
    """eval.py's --word-probe N and --word-probe-times (common.diffusion.text_conditioned.word_probe)."""
    from common.cli import count_arg, noise_levels_arg
    from common.diffusion.text_conditioned import PROBE_TIMES
    p.add_argument("--word-probe", type=count_arg(1, zero_ok=True), default=0, metavar="N",
                   help=f"also probe whether the {words} words reach the denoiser, on the first N held-out real "
                        f"{data} samples (default 0: off; 64 is a useful figure)")
    p.add_argument("--word-probe-times", type=noise_levels_arg(allow_empty=False), default=list(PROBE_TIMES),
                   metavar="T1,T2,...", help="the word probe's noise levels (default "
                   + ",".join(f"{t:g}" for t in PROBE_TIMES) + "; 1 asks whether the word sets the prediction "
                   "from pure noise)")


def _generation(comp, args) -> tuple[int, float]:
    return args.steps or comp.cfg.sample.steps, comp.cfg.sample.cfg if args.cfg is None else args.cfg


def sample(spec: PipelineSpec, argv=None, doc: str = "") -> int:
    """sample.py: writes one file set per sample, index.jsonl (file -> prompt, seed, ...) and a grid."""
    noun = spec.media_noun.rstrip("s")
    p = argparse.ArgumentParser(prog=prog(spec, "sample"), description=doc.split("\n\n")[0] or None)
    p.add_argument("--run", required=True, help="run directory (holds config.yaml and checkpoints/)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts", help="a text file with one prompt per line")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--num", type=int, default=1, help=f"{spec.media_noun} per prompt (default 1)")
    _add_generation_args(p, noun)
    dests = [p.add_argument(*flags, **kw).dest for flags, kw in spec.sample_options]
    add_checkpoint_arg(p)
    args = p.parse_args(argv)
    if args.num < 1:
        raise ConfigError("--num must be >= 1")
    options = {d: getattr(args, d) for d in dests}
    prompts = read_prompts(args)
    comp, meta = load_run(spec, args.run, args.checkpoint)
    steps, guidance = _generation(comp, args)
    jobs = [(pr, args.seed + i) for i, pr in enumerate(pr for pr in prompts for _ in range(args.num))]
    media = spec.generate(comp, comp.model, [j[0] for j in jobs], [j[1] for j in jobs], steps=steps,
                          guidance=guidance, device=torch.device("cpu"),
                          **{k: v for k, v in options.items() if k in spec.generate_options})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "index.jsonl"), "w") as index:
        for i, ((prompt, seed), item) in enumerate(zip(jobs, media)):
            files, extra = spec.write_item(item, os.path.join(args.out, f"{i:05d}"), comp, options)
            index.write(json.dumps({**files, "prompt": prompt, "seed": seed, **extra, "steps": steps,
                                    "cfg": guidance, "checkpoint": meta["path"]}) + "\n")
    grid = spec.write_grid(media, os.path.join(args.out, "grid"), comp, options)
    print(f"wrote {len(media)} {spec.media_noun}, index.jsonl and {'/'.join(os.path.basename(g) for g in grid)} "
          f"to {args.out} (checkpoint {meta['path']}, step {meta['step']})")
    return 0


def write_eval(run_dir: str, result: dict, checkpoint: str | None = None) -> str:
    """RUN/eval.json for the run's latest checkpoint; RUN/eval_step_XXXXXXXX.json for one named by
    --checkpoint, so scoring an earlier checkpoint keeps the latest's figures. Returns the path."""
    name = "eval.json" if checkpoint is None else f"eval_step_{result['step']:08d}.json"
    path = os.path.join(run_dir, name)
    write_text_durably(path, json.dumps(result, indent=1))
    return path


def evaluate(spec: PipelineSpec, argv=None, doc: str = "", *, default_num: int, grid_max: int, needs: str,
             data_hint: str,
             score: Callable[[torch.Tensor, list[dict]], dict], report: Callable[[dict], str],
             add_args: Callable[[argparse.ArgumentParser], None] | None = None,
             extend: Callable[[argparse.Namespace, object, list, dict], list[str]] | None = None) -> int:
    """eval.py: the first `--num` held-out samples' captions as prompts, the generated media
    scored against the samples' attributes by `score(media, attributes)`, written by write_eval.
    needs: an attribute the held-out json must carry; report(result) -> the summary line;
    extend(args, comp, examples, result) adds to result and returns extra lines to print."""
    p = argparse.ArgumentParser(prog=prog(spec, "eval"), description=doc.split("\n\n")[0] or None)
    p.add_argument("--run", required=True, help="run directory")
    p.add_argument("--shards", default=None, help="held-out shards (default: the run's data.eval_shards)")
    p.add_argument("--num", type=int, default=default_num, help=f"held-out prompts to generate (default {default_num})")
    _add_generation_args(p, spec.media_noun.rstrip("s"))
    add_checkpoint_arg(p)
    p.add_argument("--save-grid", default=None, help=f"also write the first {grid_max} generated {spec.media_noun} "
                                                     "as a grid at this path")
    if add_args:
        add_args(p)
    args = p.parse_args(argv)
    if args.num < 1:
        raise ConfigError("--num must be >= 1")
    comp, meta = load_run(spec, args.run, args.checkpoint)
    if args.shards is None:
        args.shards = comp.cfg.data.eval_shards
    examples = first_examples(args.shards, args.num)
    if not examples or needs not in examples[0][1]:
        raise ConfigError(f"the held-out shards carry no {needs} attributes (json); eval needs {data_hint} shards")
    steps, guidance = _generation(comp, args)
    prompts = [e[0] for e in examples]
    media = spec.generate(comp, comp.model, prompts, [args.seed + i for i in range(len(prompts))], steps=steps,
                          guidance=guidance, device=torch.device("cpu"))
    result = score(media, [e[1] for e in examples])
    result.update({"step": meta["step"], "checkpoint": meta["path"], "steps": steps, "cfg": guidance})
    lines = extend(args, comp, examples, result) if extend else []
    lines.append(f"wrote {write_eval(args.run, result, args.checkpoint)}")
    if args.save_grid:
        stem, ext = os.path.splitext(args.save_grid)
        spec.write_grid(media[:grid_max], stem if ext in (".png", ".mp4", ".gif") else args.save_grid, comp, {})
    print(f"eval on {result['n']} held-out prompts (step {meta['step']}): {report(result)}")
    for line in lines:
        print(line)
    return 0
