"""Evaluate a text2video run on held-out prompts from the synthetic video dataset.

For each held-out clip the caption is the prompt; the generated clip is analysed from its
frames alone (data.motion_analysis) and compared with the clip's attributes. Prints colour,
shape and motion accuracy and writes eval.json into the run directory.

  python -m pipelines.text2video.eval --run RUN_DIR [--shards SPEC] [--num N] [--steps S] [--cfg W]
"""
from __future__ import annotations

import argparse
import json
import os

from common.cli import run_cli
from common.config import ConfigError
from data.motion_analysis import score
from pipelines.text2video import components
from pipelines.text2video.data import first_examples
from pipelines.text2video.sample import load_run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines.text2video.eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="run directory")
    p.add_argument("--shards", default=None, help="held-out shards (default: the run's data.eval_shards)")
    p.add_argument("--num", type=int, default=64, help="held-out prompts to generate (default 64)")
    p.add_argument("--steps", type=int, default=None, help="sampler steps (default: the run's sample.steps)")
    p.add_argument("--cfg", type=float, default=None, help="guidance weight (default: the run's sample.cfg)")
    p.add_argument("--seed", type=int, default=0, help="noise seed of the first clip")
    p.add_argument("--save-grid", default=None, help="also write the first 16 clips tiled as STEM.mp4 / STEM.gif")
    args = p.parse_args(argv)
    if args.num < 1:
        raise ConfigError("--num must be >= 1")
    comp, meta = load_run(args.run)
    examples = first_examples(args.shards or comp.cfg.data.eval_shards, args.num)
    if not examples or "motion" not in examples[0][1]:
        raise ConfigError("the held-out shards carry no shape/colour/motion attributes (json); "
                          "eval needs data.synth --video shards")
    steps = args.steps or comp.cfg.sample.steps
    guidance = comp.cfg.sample.cfg if args.cfg is None else args.cfg
    prompts = [e[0] for e in examples]
    clips = components.generate(comp, comp.model, prompts, [args.seed + i for i in range(len(prompts))],
                                steps=steps, guidance=guidance)
    result = score(list(clips.numpy()), [e[1] for e in examples])
    result.update({"step": meta["step"], "checkpoint": meta["path"], "steps": steps, "cfg": guidance})
    with open(os.path.join(args.run, "eval.json"), "w") as f:
        json.dump(result, f, indent=1)
    if args.save_grid:
        components.save_video_grid(clips[:16], args.save_grid, comp.cfg.sample.fps, comp.cfg.sample.scale)
    print(f"eval on {result['n']} held-out prompts (step {meta['step']}): colour accuracy {result['colour_acc']:.1%}, "
          f"shape accuracy {result['shape_acc']:.1%}, motion accuracy {result['motion_acc']:.1%}, "
          f"all three {result['all_acc']:.1%}")
    return 0


if __name__ == "__main__":
    run_cli(main)
