"""Evaluate a text2video run on held-out prompts from the synthetic video dataset.

For each held-out clip the caption is the prompt; the generated clip is analysed from its
frames alone (data.motion_analysis) and compared with the clip's attributes. Prints colour,
shape and motion accuracy and writes eval.json into the run directory.

`--probe-t 0.6,0.9` also measures where motion is lost: each held-out clip is noised to t (seeded),
the model predicts the clean clip in one step (x0 = x_t - t v) from its caption, and the analyser
reads the motion of that prediction. High accuracy at moderate t with low sample accuracy means
the denoiser keeps motion it is shown but the caption does not set it at high noise, where the
sampler decides the trajectory.

  python -m pipelines.text2video.eval --run RUN_DIR [--shards SPEC] [--num N] [--steps S] [--cfg W]
                                      [--probe-t T1,T2,...]
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from common.cli import run_cli
from common.config import ConfigError
from common.data import ShardIndex, expand_shards
from data.motion_analysis import score
from pipelines.text2video import components
from pipelines.text2video.data import ClipDecoder, first_examples
from pipelines.text2video.sample import load_run


@torch.no_grad()
def denoise_probe(comp, model, spec: str, n: int, ts, seed: int = 0, batch_size: int = 16) -> dict:
    """{t: motion accuracy of the one-step clean prediction from the clip noised to t} over the
    first n clips of `spec` (pixel space only)."""
    if comp.vae is not None:
        raise ConfigError("--probe-t needs a pixel-space run (the analyser reads pixels)")
    c, frames, h, w = comp.clip_shape
    decoder, index = ClipDecoder(frames, (h, w)), ShardIndex(expand_shards(spec))
    clips, captions, attrs = [], [], []
    positions = ((shard, i) for shard, size in enumerate(index.shard_sizes) for i in range(size))
    for shard_id, sample_id in positions:
        if len(clips) == n:
            break
        s = index.read(shard_id, sample_id)
        d = decoder(s)
        clips.append(d["video"])
        captions.append(d["caption"])
        attrs.append(json.loads(s["json"]))
    model.eval()
    out = {}
    for t in ts:
        preds = []
        for i in range(0, len(clips), batch_size):
            x0 = torch.stack(clips[i:i + batch_size])
            g = torch.Generator().manual_seed(seed + i)
            x_t = (1 - t) * x0 + t * torch.randn(x0.shape, generator=g)
            ctx, mask = comp.text_encoder(captions[i:i + batch_size])
            v = model(x_t, torch.full((len(x0),), float(t)), ctx, mask)
            preds.append(components.to_uint8(x_t - t * v))
        out[float(t)] = score(list(torch.cat(preds).numpy()), attrs)["motion_acc"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines.text2video.eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="run directory")
    p.add_argument("--shards", default=None, help="held-out shards (default: the run's data.eval_shards)")
    p.add_argument("--num", type=int, default=64, help="held-out prompts to generate (default 64)")
    p.add_argument("--steps", type=int, default=None, help="sampler steps (default: the run's sample.steps)")
    p.add_argument("--cfg", type=float, default=None, help="guidance weight (default: the run's sample.cfg)")
    p.add_argument("--seed", type=int, default=0, help="noise seed of the first clip")
    p.add_argument("--save-grid", default=None, help="also write the first 16 clips tiled as STEM.mp4 / STEM.gif")
    p.add_argument("--probe-t", default="", help="comma-separated noise levels in (0, 1] for the denoising probe "
                                                  "(see above); empty: skip it")
    args = p.parse_args(argv)
    if args.num < 1:
        raise ConfigError("--num must be >= 1")
    try:
        probe_ts = [float(v) for v in args.probe_t.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--probe-t={args.probe_t!r}: expected numbers like 0.6,0.9") from None
    if any(not 0 < t <= 1 for t in probe_ts):
        raise ConfigError(f"--probe-t={args.probe_t!r}: every t must be in (0, 1]")
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
    if probe_ts:
        probe = denoise_probe(comp, comp.model, args.shards or comp.cfg.data.eval_shards, args.num, probe_ts, args.seed)
        result["denoise_probe_motion_acc"] = {str(t): acc for t, acc in probe.items()}
    with open(os.path.join(args.run, "eval.json"), "w") as f:
        json.dump(result, f, indent=1)
    if args.save_grid:
        components.save_video_grid(clips[:16], args.save_grid, comp.cfg.sample.fps, comp.cfg.sample.scale)
    print(f"eval on {result['n']} held-out prompts (step {meta['step']}): colour accuracy {result['colour_acc']:.1%}, "
          f"shape accuracy {result['shape_acc']:.1%}, motion accuracy {result['motion_acc']:.1%}, "
          f"all three {result['all_acc']:.1%}")
    if probe_ts:
        print("denoising probe, motion accuracy of the one-step prediction from the clip noised to t: "
              + ", ".join(f"t={t:g} {acc:.1%}" for t, acc in probe.items()))
    return 0


if __name__ == "__main__":
    run_cli(main)
