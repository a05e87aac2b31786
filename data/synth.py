"""Synthetic compositional shapes dataset: the default data every pipeline trains on out of the box.

    python -m data.synth --out datasets/shapes            # 20000 train + 512 held-out, 32 px

Writes WebDataset shards DIR/train/shard-000000.tar ... and DIR/heldout/shard-000000.tar ...,
each sample holding `__key__`, `png`, `txt` (caption) and `json` (attributes), then
DIR/manifest.json last, so its presence marks a complete dataset. The held-out split contains only
the (shape, colour) pairs in `data.shapes.HELDOUT_COMBOS`, which never occur in train.

Output is a pure function of the arguments: every sample draws from its own generator seeded by
(seed, split, index), PNGs are encoded with fixed settings and tar members get mtime 0, so the same
arguments give byte-identical shards on any run.

Video mode (`--video`): see `data/synth_video.py`. VQA mode (`--vqa`, images of 1-3 shapes with
question/answer conversations for VLMs): see `data/synth_vqa.py`. 3-D mode (`--3d`, coloured
primitives as point clouds plus occupancy, for text-to-3D): see `data/synth_3d.py`.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from data import shapes as S
from data.synth_common import load_manifest  # noqa: F401  (re-exported: synth.load_manifest reads any mode's)
from data.synth_common import RADIUS_JITTER, SPLIT_CODE, article, check_at_least, encode_png, reuse_or_generate, write_dataset
from data.synth_3d import generate_3d
from data.synth_video import MOTIONS, VIDEO_FORMATS, generate_video
from data.synth_vqa import generate_vqa

FORMAT_VERSION = 1
_POS_JITTER = 0.06  # fraction of the image side around the named grid point

# Every template names the colour and the shape; the others add size, position and background so
# text encoders see the same attribute phrased several ways.
TEMPLATES: list[str] = [
    "{a_colour} {shape}",
    "{colour} {shape}",
    "{a_size} {colour} {shape}",
    "{a_colour} {shape} on a {background} background",
    "{a_size} {colour} {shape} {position}",
    "a picture of {a_size} {colour} {shape}, {background} background",
    "{a_colour} {shape} {position} on a {background} background",
    "there is {a_colour} {shape} {position} of the image",
    "{background} background with {a_size} {colour} {shape}",
    "a {shape} coloured {colour}",
    "{a_size} {colour} {shape} on {background}",
    "an image of {a_colour} {shape}",
]


def caption(attrs: dict, template: int) -> str:
    """Fill template `template` with a sample's attributes."""
    pos = S.POSITIONS[attrs["position"]][2]
    text = TEMPLATES[template].format(
        colour=attrs["colour"],
        a_colour=article(attrs["colour"]),
        shape=attrs["shape"],
        size=attrs["size"],
        a_size=article(attrs["size"]),
        background=attrs["background"],
        position=pos,
    )
    return text


def sample_attrs(split: str, index: int, seed: int, size_px: int) -> dict:
    """Attributes and caption of sample `index` of `split`; depends on nothing else.

    Per-sample generators make a sample independent of `count` and of generation order, so a
    larger dataset extends a smaller one and generation could be split across processes.
    """
    rng = np.random.default_rng([seed, SPLIT_CODE[split], index])
    combos = S.train_combos() if split == "train" else S.HELDOUT_COMBOS
    shape, colour = combos[rng.integers(len(combos))]
    background = list(S.BACKGROUNDS)[rng.integers(len(S.BACKGROUNDS))]
    size_name = list(S.SIZES)[rng.integers(len(S.SIZES))]
    pos_name = list(S.POSITIONS)[rng.integers(len(S.POSITIONS))]
    radius = S.SIZES[size_name] * (1.0 + rng.uniform(-RADIUS_JITTER, RADIUS_JITTER))
    gx, gy, _ = S.POSITIONS[pos_name]
    # Keep at least 1.5 px of pure background around the shape: the analyser reads the background
    # from the border, and a clipped shape would no longer match its name.
    lo, hi = radius + 1.5 / size_px, 1.0 - radius - 1.5 / size_px
    cx = float(np.clip(gx + rng.uniform(-_POS_JITTER, _POS_JITTER), lo, hi))
    cy = float(np.clip(gy + rng.uniform(-_POS_JITTER, _POS_JITTER), lo, hi))
    attrs = {
        "shape": shape,
        "colour": colour,
        "background": background,
        "position": pos_name,
        "size": size_name,
        "cx": round(cx, 6),
        "cy": round(cy, 6),
        "radius": round(float(radius), 6),
        "colour_rgb": list(S.COLOURS[colour]),
        "background_rgb": list(S.BACKGROUNDS[background]),
        "image_size": size_px,
        "split": split,
        "index": index,
        "seed": seed,
    }
    attrs["template"] = int(rng.integers(len(TEMPLATES)))
    attrs["caption"] = caption(attrs, attrs["template"])
    return attrs


def render_sample(attrs: dict) -> np.ndarray:
    return S.render(
        attrs["shape"], attrs["colour"], attrs["background"],
        attrs["cx"], attrs["cy"], attrs["radius"], attrs["image_size"],
    )  # fmt: skip


def make_sample(split: str, index: int, seed: int, size_px: int) -> dict:
    """One WebDataset sample dict (all values bytes/str), ready for a ShardWriter."""
    attrs = sample_attrs(split, index, seed, size_px)
    return {
        "__key__": f"{split}-{index:08d}",
        "png": encode_png(render_sample(attrs)),
        "txt": attrs["caption"],
        "json": json.dumps(attrs, sort_keys=True).encode("utf-8"),
    }


def generate(
    out: str,
    count: int = 20000,
    heldout_count: int = 512,
    size: int = 32,
    shard_size: int = 1000,
    seed: int = 0,
    progress: bool = False,
) -> dict:
    """Write the dataset to `out` and return the summary (also written to out/manifest.json).

    Summary keys: out, args, counts {split: n}, shards {split: [relative paths]}, heldout_combos,
    vocabulary, seconds.
    """
    check_at_least(("count", count, 0), ("heldout_count", heldout_count, 0), ("size", size, 8),
                   ("shard_size", shard_size, 1))

    def make(split, i):
        return make_sample(split, i, seed, size)

    manifest = {
        "format_version": FORMAT_VERSION,
        "args": {"count": count, "heldout_count": heldout_count, "size": size,
                 "shard_size": shard_size, "seed": seed},  # fmt: skip
        "heldout_combos": [list(c) for c in S.HELDOUT_COMBOS],
        "vocabulary": {
            "shapes": S.SHAPES,
            "colours": {k: list(v) for k, v in S.COLOURS.items()},
            "backgrounds": {k: list(v) for k, v in S.BACKGROUNDS.items()},
            "sizes": S.SIZES,
            "positions": list(S.POSITIONS),
            "templates": TEMPLATES,
        },
    }
    return write_dataset(out, count, heldout_count, shard_size, make, manifest, progress)


def ensure(out: str, **kwargs) -> dict:
    """Generate into `out` unless a complete dataset with the same arguments is already there.

    What a trainer's demo config calls: the first run pays the generation, later ones reuse it.
    """
    defaults = {"count": 20000, "heldout_count": 512, "size": 32, "shard_size": 1000, "seed": 0}
    return reuse_or_generate(out, defaults, kwargs, generate, format_version=FORMAT_VERSION)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m data.synth",
        description="Generate the synthetic shapes dataset (shape x colour x size x position x "
        "background) as WebDataset shards, with a held-out split of (shape, colour) pairs never "
        "seen in training. Same arguments -> byte-identical output. With --video: clips of one "
        "shape moving (left_to_right, right_to_left, up, down), growing, shrinking or static. With "
        "--vqa: visual question answering for VLMs, 1-3 shapes per image on a 3x3 grid with 2-4 "
        "questions about colour, shape, count and position in the layout of `make_shards "
        "conversations` (json turns, first user turn starting with <image>, plus a qa list and a "
        "txt caption); the held-out split holds the (colour, shape, count) compositions listed in "
        "data/synth_vqa.py, never seen in training. With --3d: one coloured 3-D primitive per sample "
        "(sphere, cube, cylinder, cone, torus, pyramid, capsule x size x aspect x position) as an "
        "(N, 6) xyz+rgb surface point cloud (npy) plus occupancy queries (occ.npy: xyz, inside, rgb), "
        "captioned; held-out (shape, colour) pairs as listed in data/shapes3d.py.",
    )
    p.add_argument("--out", required=True, help="output folder; gets train/, heldout/, manifest.json")
    p.add_argument("--count", type=int, default=None,
                   help="training samples (default 20000 images / 5000 clips / 20000 VQA images / 8000 3-D)")
    p.add_argument("--heldout-count", type=int, default=None,
                   help="held-out samples, all from held-out (shape, colour) pairs, or (colour, shape, count) "
                   "compositions with --vqa (default 512 / 256 / 512 / 448)")
    p.add_argument("--size", type=int, default=None,
                   help="image side in pixels, >= 8 (default 32; with --vqa >= 24, default 48 so each "
                   "grid cell holds a legible shape)")
    p.add_argument("--shard-size", type=int, default=None,
                   help="samples per tar shard (default 1000 images / 500 clips / 1000 VQA images / 1000 3-D)")
    p.add_argument("--seed", type=int, default=0, help="random seed; fixes every byte of the output (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    v = p.add_argument_group("video mode")
    v.add_argument("--video", action="store_true", help="generate video clips instead of images")
    v.add_argument("--sizes", default=None,
                   help="comma-separated clip sides, each clip draws one (even, >= 16; default: --size)")
    v.add_argument("--frames", default="8", help="comma-separated frame counts, each clip draws one (default 8)")
    v.add_argument("--fps", type=float, default=8.0, help="frames per second (default 8)")
    v.add_argument("--motions", default=",".join(MOTIONS),
                   help=f"comma-separated subset of {','.join(MOTIONS)} (default all)")
    v.add_argument("--format", dest="fmt", choices=VIDEO_FORMATS, default="mp4",
                   help="mp4 (H.264, as real video shards; default), npy (lossless uint8 T,H,W,3) or both")
    v.add_argument("--raw-frames", action="store_true", help="same as --format npy")
    v.add_argument("--crf", type=int, default=23, help="libx264 CRF of the mp4 clips (default 23)")
    q = p.add_argument_group("VQA mode")
    q.add_argument("--vqa", action="store_true",
                   help="generate images of 1-3 shapes with question/answer conversations and captions "
                   "(data/synth_vqa.py)")
    t = p.add_argument_group("3-D mode")
    t.add_argument("--3d", dest="three_d", action="store_true",
                   help="generate coloured 3-D primitives as point clouds with occupancy (data/synth_3d.py)")
    t.add_argument("--points", type=int, default=2048, help="surface points per sample, npy (default 2048)")
    t.add_argument("--occupancy", type=int, default=2048,
                   help="occupancy queries per sample, occ.npy; 0: none (default 2048)")
    return p


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    size = 32 if a.size is None else a.size
    try:
        if a.video + a.vqa + a.three_d > 1:
            raise ValueError("--video, --vqa and --3d are separate datasets: give one of them")
        if a.three_d:
            if a.size is not None:
                raise ValueError("--size does not apply to --3d (the scene is the unit cube)")
            summary = generate_3d(a.out, 8000 if a.count is None else a.count,
                                  448 if a.heldout_count is None else a.heldout_count, a.points, a.occupancy,
                                  1000 if a.shard_size is None else a.shard_size, a.seed,
                                  progress=not a.no_progress)  # fmt: skip
        elif a.vqa:
            summary = generate_vqa(a.out, 20000 if a.count is None else a.count,
                                   512 if a.heldout_count is None else a.heldout_count,
                                   48 if a.size is None else a.size,
                                   1000 if a.shard_size is None else a.shard_size, a.seed,
                                   progress=not a.no_progress)  # fmt: skip
        elif a.video:
            summary = generate_video(
                a.out, 5000 if a.count is None else a.count,
                256 if a.heldout_count is None else a.heldout_count,
                _ints(a.sizes) if a.sizes else [size], _ints(a.frames),
                500 if a.shard_size is None else a.shard_size, a.seed, a.fps,
                [m.strip() for m in a.motions.split(",") if m.strip()],
                "npy" if a.raw_frames else a.fmt, a.crf, progress=not a.no_progress,
            )  # fmt: skip
        else:
            summary = generate(a.out, 20000 if a.count is None else a.count,
                               512 if a.heldout_count is None else a.heldout_count, size,
                               1000 if a.shard_size is None else a.shard_size, a.seed,
                               progress=not a.no_progress)  # fmt: skip
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n_shards = sum(len(v) for v in summary["shards"].values())
    c = summary["counts"]
    print(f"wrote train = {c['train']}, heldout = {c['heldout']} samples in {n_shards} shards "
          f"to {summary['out']} ({summary['seconds']:.1f} s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
