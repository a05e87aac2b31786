"""Generate clips from a text2video run's latest checkpoint (EMA weights).

  python -m pipelines.text2video.sample --run RUN_DIR (--prompt TEXT | --prompts FILE) --out DIR
         [--num N] [--steps S] [--cfg W] [--seed K] [--frames T] [--fps F] [--scale K]

Writes one MP4 and one GIF per clip, index.jsonl (file -> prompt, seed) and grid.mp4 / grid.gif.
A latent-space run (vae.path in its config.yaml) reloads the VAE from that folder and decodes the
sampled latents to pixels; the checkpoint's signature must match that VAE's latent space.
"""
from __future__ import annotations

import argparse
import json
import os


from common.checkpoint import load_for_inference
from common.cli import run_cli
from common.config import ConfigError, from_yaml_file
from pipelines.text2image.sample import read_prompts
from pipelines.text2video import components
from pipelines.text2video.config import T2VConfig


def load_run(run_dir: str, checkpoint: str | None = None, use_ema: bool = True):
    """(components, meta) with the checkpoint's weights (EMA if present) loaded; single process, eval mode."""
    cfg = from_yaml_file(T2VConfig, components.check_run_dir(run_dir))
    comp = components.build(cfg)
    meta = load_for_inference(checkpoint or os.path.join(run_dir, "checkpoints"), comp.model,
                              {"text_encoder": comp.text_encoder}, components.signature(cfg, comp),
                              use_ema=use_ema and cfg.train.ema_decay > 0)
    return comp, meta


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines.text2video.sample", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="run directory (holds config.yaml and checkpoints/)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts", help="a text file with one prompt per line")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--num", type=int, default=1, help="clips per prompt (default 1)")
    p.add_argument("--steps", type=int, default=None, help="sampler steps (default: the run's sample.steps)")
    p.add_argument("--cfg", type=float, default=None, help="guidance weight (default: the run's sample.cfg)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first clip; clip i uses seed + i")
    p.add_argument("--frames", type=int, default=None,
                   help="pixel frames per clip (default: the run's model.frames; with a causal video VAE "
                        "1 + k * its temporal factor, e.g. 5, 9, 17 for Wan)")
    p.add_argument("--fps", type=float, default=None, help="frame rate of the files (default: the run's sample.fps)")
    p.add_argument("--scale", type=int, default=None, help="nearest upscale of the files (default: sample.scale)")
    p.add_argument("--checkpoint", default=None, help="a specific checkpoint directory (default: latest)")
    args = p.parse_args(argv)
    if args.num < 1:
        raise ConfigError("--num must be >= 1")
    if args.frames is not None and args.frames < 1:
        raise ConfigError("--frames must be >= 1")
    prompts = read_prompts(args)
    comp, meta = load_run(args.run, args.checkpoint)
    sc = comp.cfg.sample
    steps, fps, scale = args.steps or sc.steps, args.fps or sc.fps, args.scale or sc.scale
    guidance = sc.cfg if args.cfg is None else args.cfg
    jobs = [(pr, args.seed + i) for i, pr in enumerate(pr for pr in prompts for _ in range(args.num))]
    clips = components.generate(comp, comp.model, [j[0] for j in jobs], [j[1] for j in jobs], steps=steps,
                                guidance=guidance, frames=args.frames)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "index.jsonl"), "w") as index:
        for i, ((prompt, seed), clip) in enumerate(zip(jobs, clips)):
            name = f"{i:05d}"
            components.save_mp4(clip.numpy(), os.path.join(args.out, name + ".mp4"), fps, scale)
            components.save_gif(clip.numpy(), os.path.join(args.out, name + ".gif"), fps, scale)
            index.write(json.dumps({"file": name + ".mp4", "gif": name + ".gif", "prompt": prompt, "seed": seed,
                                    "frames": int(clip.shape[0]), "steps": steps, "cfg": guidance,
                                    "checkpoint": meta["path"]}) + "\n")
    components.save_video_grid(clips, os.path.join(args.out, "grid"), fps, scale)
    print(f"wrote {len(clips)} clips (mp4 + gif), index.jsonl and grid.mp4/grid.gif to {args.out} "
          f"(checkpoint {meta['path']}, step {meta['step']})")
    return 0


if __name__ == "__main__":
    run_cli(main)
