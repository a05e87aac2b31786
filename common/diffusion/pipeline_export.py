"""What the export commands of the text-conditioned diffusion pipelines share (text2image and
text2video `export.py`): which checkpoint to read, whether --out may be written, which weights the
folder holds, and the atomic write of the folder. Imports no diffusers, so that the command's
one-line errors come before that import (and its warnings) does."""
from __future__ import annotations

import argparse
import os
import shutil
from typing import Callable

from common.cli import add_checkpoint_arg

__all__ = ["checkpoint_has_ema", "resolve_run_checkpoint", "check_out_folder", "describe_weights", "save_folder",
           "export_main"]


def checkpoint_has_ema(ckpt: str) -> bool:
    """Whether a complete checkpoint directory holds an EMA copy of the model."""
    import torch.distributed.checkpoint as dcp
    keys = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    return any(k.startswith("ema.") for k in keys)


def resolve_run_checkpoint(run: str, checkpoint: str | None) -> str:
    """The complete checkpoint an export reads: `checkpoint`, or the run's latest. ConfigError for a
    missing run, CheckpointError for a run without one."""
    from common.checkpoint import CheckpointError, resolve_checkpoint
    from common.config import ConfigError
    from common.run import check_run_dir
    if not os.path.isdir(run):
        raise ConfigError(f"run directory not found: {run}")
    check_run_dir(run)
    try:
        return resolve_checkpoint(checkpoint or os.path.join(run, "checkpoints"))
    except CheckpointError:
        if checkpoint:
            raise
        raise CheckpointError(f"{run} holds no complete checkpoint (train it first, or pass --checkpoint)") from None


def check_out_folder(out: str, overwrite: bool) -> None:
    """ConfigError unless `out` is absent, empty, or a folder --overwrite may replace."""
    from common.config import ConfigError
    if os.path.isfile(out) or (os.path.isdir(out) and os.listdir(out) and not overwrite):
        raise ConfigError(f"--out {out} exists and is not empty (pass --overwrite to replace it)")


def describe_weights(use_ema: bool, has_ema: bool, ema_decay: float) -> str:
    """Which weights an export holds, for its log line and model card."""
    if use_ema:
        return f"EMA weights (decay {ema_decay:g})"
    return "trained weights" + (" (--weights trained)" if has_ema else " (the checkpoint has no EMA copy)")


def save_folder(pipe, out: str, texts: dict[str, str]) -> None:
    """pipe.save_pretrained (safetensors) plus a text file per texts[name], written beside `out` and
    renamed when complete: an interrupted or failed export leaves no half-written folder where a
    loader would find it (and an existing `out` untouched until then)."""
    tmp = out + ".export-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        pipe.save_pretrained(tmp, safe_serialization=True)
        for name, text in texts.items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.rename(tmp, out)


def export_main(argv, *, prog: str, doc: str, load_spec: Callable, build_pipeline: Callable,
                model_card: Callable, summary: Callable, add_options: Callable | None = None) -> int:
    """An export command: parse --run/--out/--checkpoint/--weights/--overwrite, check them before
    anything heavy is imported, load the run's checkpoint (EMA or trained weights), build the
    pipeline (build_pipeline(comp, **options)), write it with the run's config.yaml and a model card
    (model_card(comp, meta, ckpt, weights, pipe, run) -> markdown) and print one line
    (summary(comp, pipe): what the folder holds). load_spec() returns the pipeline's PipelineSpec.
    add_options(parser) -> [dest, ...]: a pipeline's own options, passed to build_pipeline by name."""
    from common.run import load_run
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="run directory (config.yaml and checkpoints/)")
    p.add_argument("--out", required=True, help="pipeline folder to write (must not exist or be empty)")
    add_checkpoint_arg(p)
    p.add_argument("--weights", choices=("ema", "trained"), default="ema",
                   help="ema (default): the checkpoint's EMA copy, or the trained weights where it has none")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    option_names = add_options(p) if add_options is not None else []
    args = p.parse_args(argv)
    ckpt = resolve_run_checkpoint(args.run, args.checkpoint)
    out = os.path.normpath(args.out)
    check_out_folder(out, args.overwrite)

    has_ema = checkpoint_has_ema(ckpt)
    use_ema = args.weights == "ema" and has_ema
    comp, meta = load_run(load_spec(), args.run, ckpt, use_ema=use_ema)
    if getattr(comp, "text_encoder", None) is not None:
        # A tower held in bf16 for training (text.dtype) is written in fp32 like every other part:
        # a pipeline loaded without torch_dtype must hold one dtype. Its values stay the bf16 ones.
        comp.text_encoder.float()
    weights = describe_weights(use_ema, has_ema, comp.cfg.train.ema_decay)
    pipe = build_pipeline(comp, **{name: getattr(args, name) for name in option_names})
    with open(os.path.join(args.run, "config.yaml")) as f:
        training_config = f.read()
    save_folder(pipe, out, {"training_config.yaml": training_config,
                            "README.md": model_card(comp, meta, ckpt, weights, pipe, args.run)})
    remote = not type(pipe).__module__.startswith("diffusers.")  # this project's pipeline: the folder's shim loads it
    print(f"exported {ckpt} (step {meta['step']}, {weights}) to {out}: {summary(comp, pipe)}; load with "
          f"DiffusionPipeline.from_pretrained({out!r}{', trust_remote_code=True' if remote else ''})")
    return 0
