"""Evaluate a text2image run on held-out prompts from the synthetic dataset.

For each held-out sample the caption is used as the prompt; the generated image is analysed
from its pixels alone (data.shape_analysis) and compared with the sample's attributes. Prints
colour, shape and joint accuracy and writes eval.json into the run directory (eval_step_N.json
for an earlier checkpoint given by --checkpoint, so the latest's figures are kept).

Diversity, beside accuracy: for the first held-out colour/shape classes, `--diversity` samples of
the prompt "a COLOUR SHAPE" (which leaves background, place and size to the model), their mean
pairwise pixel distance over that of the class's real held-out images, at the same guidance.

Word probe (`--word-probe N`, off by default): for the first N held-out real images, the model's
denoising error under each caption made by swapping the shape word (then the colour word) of the
image's own caption, the same noise for all; the share whose lowest error is the true word. It
tells a word that does not reach the denoiser from a shape the sampler cannot draw yet.

  python -m pipelines.text2image.eval --run RUN_DIR [--shards SPEC] [--num N] [--steps S] [--cfg W]
                                      [--checkpoint DIR]
"""
import argparse

import numpy as np
import torch

from common.cli import count_arg, run_cli
from common.data.captions import first_decoded, read_attributes
from common.data.images import ImageDecoder, image_bytes, open_rgb
from common.data.shards import iter_samples
from common.diffusion.text_conditioned import word_probe as shared_word_probe
from common.run import add_word_probe_args, evaluate
from data import shapes
from data.synth import caption as synth_caption
from data.shape_analysis import MIN_SPREAD, diversity_ratio, drawn_summary, mean_pairwise_distance, score
from pipelines.text2image.components import encode_images
from pipelines.text2image.spec import SPEC

REAL_PER_CLASS = 32  # real held-out images per class for the reference spread
# Held-out samples read at most while looking for them: a rare class stops the scan here rather
# than after a pass over a large eval set (the figure then uses the real images found, >= 2).
MAX_SCANNED = 4096


def add_diversity_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--diversity", type=count_arg(2, zero_ok=True), default=8,
                   help="samples per prompt for the diversity figure (default 8; 0 skips it)")
    p.add_argument("--diversity-classes", type=count_arg(1), default=4,
                   help="held-out colour/shape classes it averages over (default 4)")


def add_eval_args(p: argparse.ArgumentParser) -> None:
    add_diversity_args(p)
    add_word_probe_args(p, "shape and colour", "data.synth")


def word_probe(args, comp, result) -> list[str]:
    """Adds result["word_probe"]: whether the shape and colour words reach the denoiser
    (common.diffusion.text_conditioned.word_probe) on the first held-out real images."""
    if args.word_probe == 0:
        return []
    decode = ImageDecoder(comp.cfg.model.image_size)
    images, attrs, captions = first_decoded(
        args.shards, args.word_probe, {"shape", "colour", "template"},
        lambda s: decode(s) if image_bytes(s) is not None else None, "image", "--word-probe (data.synth images)")
    x0 = encode_images(comp, {"image": images, "__position__": torch.arange(len(images))},
                       torch.device("cpu"))

    def swapped(word):  # the caption rebuilt from its template: articles follow the word
        return lambda a, w: synth_caption({**a, word: w}, a["template"])

    result["word_probe"], line = shared_word_probe(
        comp.model, comp.text_encoder, comp.objective, x0, attrs, captions,
        {"shape": (shapes.SHAPES, swapped("shape")), "colour": (list(shapes.COLOURS), swapped("colour"))},
        seed=args.seed, times=args.word_probe_times, noun="images")
    return [line]


def extend(args, comp, examples, result) -> list[str]:
    return diversity(args, comp, examples, result) + word_probe(args, comp, result)


def diversity(args, comp, examples, result) -> list[str]:
    """Adds result["diversity"]: per class and mean ratio of sample spread to real spread."""
    if args.diversity == 0:
        return []
    classes = list(dict.fromkeys((a["colour"], a["shape"]) for _, a in examples))[:args.diversity_classes]
    real: dict[tuple, list] = {c: [] for c in classes}
    for scanned, sample in enumerate(iter_samples(args.shards)):
        if scanned >= MAX_SCANNED:
            break
        attrs = read_attributes(sample)
        c = (attrs.get("colour"), attrs.get("shape"))
        raw = image_bytes(sample)
        if c in real and len(real[c]) < REAL_PER_CLASS and raw is not None:
            real[c].append(np.asarray(open_rgb(raw)))
            if all(len(v) == REAL_PER_CLASS for v in real.values()):
                break
    # a class whose real images are all alike has no spread to compare against (diversity_ratio)
    classes = [c for c in classes if len(real[c]) >= 2 and mean_pairwise_distance(real[c]) > MIN_SPREAD]
    if not classes:
        return ["diversity: no held-out class has 2 real images that differ"]
    prompts = [f"a {colour} {shape}" for colour, shape in classes for _ in range(args.diversity)]
    seeds = [args.seed + 1_000_000 + i for i in range(len(prompts))]  # apart from the accuracy seeds
    media = SPEC.generate(comp, comp.model, prompts, seeds, steps=result["steps"], guidance=result["cfg"],
                          device=torch.device("cpu")).numpy()
    per_class = {f"{colour} {shape}": diversity_ratio(media[i * args.diversity:(i + 1) * args.diversity],
                                                      real[(colour, shape)])
                 for i, (colour, shape) in enumerate(classes)}
    mean = float(np.mean(list(per_class.values())))
    result["diversity"] = {"ratio": mean, "per_class": per_class, "samples_per_prompt": args.diversity,
                           "real_per_class": {f"{c} {s}": len(real[(c, s)]) for c, s in classes}}
    return [f"diversity at guidance {result['cfg']}: {mean:.2f} (mean pairwise pixel distance of {args.diversity} "
            f"samples of one prompt over that of real images of its class; {len(classes)} classes: "
            + ", ".join(f"{k} {v:.2f}" for k, v in per_class.items()) + ")"]


def main(argv=None) -> int:
    return evaluate(SPEC, argv, __doc__, default_num=256, grid_max=64, needs="shape", data_hint="data.synth",
                    score=lambda images, attrs: score(images.numpy(), attrs),
                    report=lambda r: (f"colour accuracy {r['colour_acc']:.1%}, shape accuracy {r['shape_acc']:.1%}, "
                                      f"both {r['both_acc']:.1%}; shapes drawn: {drawn_summary(r['drawn'])}"),
                    add_args=add_eval_args, extend=extend)


if __name__ == "__main__":
    run_cli(main)
