"""Generate images from a text2image run's latest checkpoint (EMA weights).

  python -m pipelines.text2image.sample --run RUN_DIR (--prompt TEXT | --prompts FILE) --out DIR
         [--num N] [--steps S] [--cfg W] [--seed K]

Writes one PNG per image, index.jsonl (file -> prompt, seed) and grid.png.
"""
from __future__ import annotations

import argparse
import json
import os

from PIL import Image

from common.checkpoint import load_for_inference
from common.cli import run_cli
from common.config import ConfigError, from_yaml_file
from pipelines.text2image import components
from pipelines.text2image.config import T2IConfig


def load_run(run_dir: str, checkpoint: str | None = None, use_ema: bool = True):
    """(components, meta) with the checkpoint's weights (EMA if present) loaded; single process, eval mode."""
    cfg = from_yaml_file(T2IConfig, components.check_run_dir(run_dir))
    comp = components.build(cfg)
    meta = load_for_inference(checkpoint or os.path.join(run_dir, "checkpoints"), comp.model,
                              {"text_encoder": comp.text_encoder}, components.signature(cfg, comp),
                              use_ema=use_ema and cfg.train.ema_decay > 0)
    return comp, meta


def read_prompts(args) -> list[str]:
    if args.prompt:
        return [args.prompt]
    if not os.path.isfile(args.prompts):
        raise ConfigError(f"--prompts file not found: {args.prompts}")
    with open(args.prompts) as f:
        prompts = [line.strip() for line in f if line.strip()]
    if not prompts:
        raise ConfigError(f"--prompts file {args.prompts} has no prompts")
    return prompts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines.text2image.sample", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="run directory (holds config.yaml and checkpoints/)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts", help="a text file with one prompt per line")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--num", type=int, default=1, help="images per prompt (default 1)")
    p.add_argument("--steps", type=int, default=None, help="sampler steps (default: the run's sample.steps)")
    p.add_argument("--cfg", type=float, default=None, help="guidance weight (default: the run's sample.cfg)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first image; image i uses seed + i")
    p.add_argument("--checkpoint", default=None, help="a specific checkpoint directory (default: latest)")
    args = p.parse_args(argv)
    if args.num < 1:
        raise ConfigError("--num must be >= 1")
    prompts = read_prompts(args)
    comp, meta = load_run(args.run, args.checkpoint)
    steps = args.steps or comp.cfg.sample.steps
    guidance = comp.cfg.sample.cfg if args.cfg is None else args.cfg
    jobs = [(pr, args.seed + i) for i, pr in enumerate(pr for pr in prompts for _ in range(args.num))]
    images = components.generate(comp, comp.model, [j[0] for j in jobs], [j[1] for j in jobs], steps=steps, guidance=guidance)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "index.jsonl"), "w") as index:
        for i, ((prompt, seed), img) in enumerate(zip(jobs, images)):
            name = f"{i:05d}.png"
            Image.fromarray(img.numpy()).save(os.path.join(args.out, name))
            index.write(json.dumps({"file": name, "prompt": prompt, "seed": seed, "steps": steps, "cfg": guidance,
                                    "checkpoint": meta["path"]}) + "\n")
    components.save_grid(images, os.path.join(args.out, "grid.png"), scale=4)
    print(f"wrote {len(images)} images, index.jsonl and grid.png to {args.out} (checkpoint {meta['path']}, step {meta['step']})")
    return 0


if __name__ == "__main__":
    run_cli(main)
