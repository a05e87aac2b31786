"""Evaluate a text2video run on held-out prompts from the synthetic video dataset.

For each held-out clip the caption is the prompt; the generated clip is analysed from its
frames alone (data.motion_analysis) and compared with the clip's attributes. Prints colour,
shape and motion accuracy and writes eval.json into the run directory (eval_step_N.json for an
earlier checkpoint given by --checkpoint, so the latest's figures are kept).

`--probe-t 0.6,0.9` also measures where motion is lost: each held-out clip is noised to t (seeded),
the model predicts the clean clip in one step (x0 = x_t - t v) from its caption, and the analyser
reads the motion of that prediction. High accuracy at moderate t with low sample accuracy means
the denoiser keeps motion it is shown but the caption does not set it at high noise, where the
sampler decides the trajectory. The probe then asks the same of each moving clip with its motion
phrase reversed in the caption ("moving up" -> "moving down", same noise): the share of those
predictions that move as the reversed caption says is how far the caption steers motion at t
(near 0% where the clip's own evidence wins or the caption is ignored).

`--word-probe N` asks whether the motion, shape and colour words reach the denoiser at all: for the
first N held-out clips, the model's denoising error under the clip's caption with the word swapped
for each other word of its kind, the same noise for all; the share whose own word gives the lowest
error (common.diffusion.text_conditioned.word_probe).

  python -m pipelines.text2video.eval --run RUN_DIR [--shards SPEC] [--num N] [--steps S] [--cfg W]
                                      [--checkpoint DIR] [--probe-t T1,T2,...] [--word-probe N]
"""
from __future__ import annotations

import argparse

import torch

from common.cli import noise_levels_arg, run_cli
from common.config import ConfigError
from common.data import ShardIndex, expand_shards
from common.data.captions import first_decoded, read_attributes
from common.diffusion.text_conditioned import to_uint8
from common.diffusion.text_conditioned import word_probe as shared_word_probe
from common.run import add_word_probe_args, evaluate
from data import shapes
from data.motion_analysis import score
from data.synth_video import MOTIONS, reverse_motion, video_caption
from pipelines.text2video.data import ClipDecoder
from pipelines.text2video.spec import SPEC


@torch.no_grad()
def denoise_probe(comp, model, spec: str, n: int, ts, seed: int = 0, batch_size: int = 16) -> dict:
    """{t: {"motion_acc": motion accuracy of the one-step clean prediction from the clip noised to t,
    "reversed_followed": share of the moving clips whose prediction, from the caption with its
    motion reversed (same noise), moves as that caption says}} over the first n clips of `spec`
    (pixel space only)."""
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
        attrs.append(read_attributes(s))
    reversed_ = [(i, *r) for i, r in enumerate(reverse_motion(cap, a) for cap, a in zip(captions, attrs)) if r]
    # Noise drawn once per clip, from its own seed: the same under every t and under its true and
    # reversed caption.
    noises = [torch.randn(clip.shape, generator=torch.Generator().manual_seed(seed + r)) for r, clip in enumerate(clips)]
    model.eval()

    def predict(t: float, rows: list[int], prompts: list[str]) -> list:
        preds = []
        for i in range(0, len(rows), batch_size):
            part = rows[i:i + batch_size]
            x0 = torch.stack([clips[r] for r in part])
            x_t = (1 - t) * x0 + t * torch.stack([noises[r] for r in part])
            ctx, mask = comp.text_encoder(prompts[i:i + batch_size])
            v = model(x_t, torch.full((len(part),), float(t)), ctx, mask)
            preds.append(to_uint8(x_t - t * v))
        return list(torch.cat(preds).numpy()) if preds else []

    out = {}
    for t in ts:
        result = {"motion_acc": score(predict(t, list(range(len(clips))), captions), attrs)["motion_acc"]}
        if reversed_:
            rows, prompts, motions = zip(*reversed_)
            target = [{**attrs[r], "motion": m} for r, m in zip(rows, motions)]
            result["reversed_followed"] = score(predict(t, list(rows), list(prompts)), target)["motion_acc"]
        out[float(t)] = result
    return out


def _probe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--probe-t", type=noise_levels_arg(), default=[],
                   help="comma-separated noise levels in (0, 1] for the denoising probe (see above); empty: skip it")
    add_word_probe_args(p, "motion, shape and colour", "data.synth --video")


def _swapped(word: str):
    """rewrite(attrs, w): the clip's caption with `word` set to w. Motion swaps only its phrase (a
    rebuilt caption would also change the size word, which follows the motion)."""
    if word == "motion":
        return lambda a, w: video_caption(a, a["template"], a["phrase"]).replace(
            MOTIONS[a["motion"]][a["phrase"]], MOTIONS[w][a["phrase"]])
    return lambda a, w: video_caption({**a, word: w}, a["template"], a["phrase"])


def word_probe(args, comp, result) -> list[str]:
    """Adds result["word_probe"] (see the module's doc)."""
    if args.word_probe == 0:
        return []
    frames, h, w = comp.pixel_clip_shape
    decoder = ClipDecoder(frames, (h, w))
    x0, attrs, captions = first_decoded(
        args.shards, args.word_probe, {"motion", "shape", "colour", "template", "phrase"}, decoder, "video",
        "--word-probe (data.synth --video clips)")
    if comp.vae is not None:
        x0 = comp.vae.encode(x0).to(x0.dtype)
    result["word_probe"], line = shared_word_probe(
        comp.model, comp.text_encoder, comp.objective, x0, attrs, captions,
        {"motion": (list(MOTIONS), _swapped("motion")), "shape": (shapes.SHAPES, _swapped("shape")),
         "colour": (list(shapes.COLOURS), _swapped("colour"))}, seed=args.seed, times=args.word_probe_times,
        noun="clips")
    return [line]


def _probe(args, comp, examples, result) -> list[str]:
    if not args.probe_t:
        return []
    probe = denoise_probe(comp, comp.model, args.shards, args.num, args.probe_t, args.seed)
    acc = {t: r["motion_acc"] for t, r in probe.items()}
    followed = {t: r["reversed_followed"] for t, r in probe.items() if "reversed_followed" in r}
    result["denoise_probe_motion_acc"] = {str(t): v for t, v in acc.items()}
    result["denoise_probe_reversed_followed"] = {str(t): v for t, v in followed.items()}
    return ["denoising probe, motion accuracy of the one-step prediction from the clip noised to t: "
            + ", ".join(f"t={t:g} {v:.1%}" for t, v in acc.items()),
            "  ... and with the caption's motion reversed, predictions that follow the reversed caption: "
            + ", ".join(f"t={t:g} {v:.1%}" for t, v in followed.items())]


def _extras(args, comp, examples, result) -> list[str]:
    return _probe(args, comp, examples, result) + word_probe(args, comp, result)


def main(argv=None) -> int:
    return evaluate(SPEC, argv, __doc__, default_num=64, grid_max=16, needs="motion", data_hint="data.synth --video",
                    score=lambda clips, attrs: score(list(clips.numpy()), attrs),
                    report=lambda r: (f"colour accuracy {r['colour_acc']:.1%}, shape accuracy {r['shape_acc']:.1%}, "
                                      f"motion accuracy {r['motion_acc']:.1%}, all three {r['all_acc']:.1%}"),
                    add_args=_probe_args, extend=_extras)


if __name__ == "__main__":
    run_cli(main)
