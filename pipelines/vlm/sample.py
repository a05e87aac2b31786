"""Answer a question about an image with a vlm run's latest checkpoint (EMA weights if kept).

  python -m pipelines.vlm.sample --run RUN_DIR --image IMG --prompt "What colour is the circle?"
         [--image IMG2 --prompt ...] [--out answers.jsonl] [--max-new-tokens N]

RUN_DIR is a stage's directory or a staged run's top directory (its last VLM stage answers).
Each --image is paired with the --prompt at the same place (one prompt is used for all images);
"<image>" in a prompt places the image, otherwise it goes before the text. Answers are printed,
and written with their image and prompt to --out as JSONL when given.
"""
from __future__ import annotations

import argparse
import json
import os

from PIL import Image, UnidentifiedImageError

from common.cli import add_checkpoint_arg, run_cli
from common.config import ConfigError
from common.run import load_run
from pipelines.vlm.components import answer
from pipelines.vlm.eval import last_vlm_stage
from pipelines.vlm.spec import SPEC


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines.vlm.sample", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="run directory (a stage's, or a staged run's top directory)")
    p.add_argument("--image", action="append", required=True, help="an image file (repeatable)")
    p.add_argument("--prompt", action="append", required=True, help="the question (repeatable: one per --image)")
    p.add_argument("--out", default=None, help="also write the answers to this JSONL file")
    p.add_argument("--max-new-tokens", type=int, default=32, help="longest answer (default 32)")
    add_checkpoint_arg(p)
    args = p.parse_args(argv)
    prompts = args.prompt if len(args.prompt) == len(args.image) else None
    if prompts is None:
        if len(args.prompt) != 1:
            raise ConfigError(f"{len(args.image)} --image but {len(args.prompt)} --prompt: give one prompt, or one per image")
        prompts = args.prompt * len(args.image)
    images = []
    for path in args.image:
        if not os.path.isfile(path):
            raise ConfigError(f"--image {path}: no such file")
        try:
            img = Image.open(path)
            img.load()
        except (UnidentifiedImageError, OSError) as e:
            raise ConfigError(f"--image {path}: not a readable image ({e})") from None
        images.append(img)
    run = last_vlm_stage(args.run)
    comp, meta = load_run(SPEC, run, args.checkpoint)
    said = answer(comp, comp.model, images, prompts, max_new_tokens=args.max_new_tokens)
    rows = [{"image": path, "prompt": q, "answer": a, "checkpoint": meta["path"]}
            for path, q, a in zip(args.image, prompts, said)]
    for r in rows:
        print(f"{r['image']}: {r['prompt']} -> {r['answer']}")
    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    run_cli(main)
