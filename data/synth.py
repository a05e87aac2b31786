"""Synthetic compositional shapes dataset: the default data every pipeline trains on out of the box.

    python -m data.synth --out datasets/shapes            # 20000 train + 512 held-out, 32 px

Writes WebDataset shards DIR/train/shard-000000.tar ... and DIR/heldout/shard-000000.tar ...,
each sample holding `__key__`, `png`, `txt` (caption) and `json` (attributes), then
DIR/manifest.json last, so its presence marks a complete dataset. The held-out split contains only
the (shape, colour) pairs in `data.shapes.HELDOUT_COMBOS`, which never occur in train.

Output is a pure function of the arguments: every sample draws from its own generator seeded by
(seed, split, index), PNGs are encoded with fixed settings and tar members get mtime 0, so the same
arguments give byte-identical shards on any run.

Video mode (`python -m data.synth --video --out DIR [--frames 8,12,16] [--sizes 32,48]`, or
`generate_video`): clips of one shape moving left_to_right / right_to_left / up / down, growing,
shrinking or static, captioned with colour, shape and motion. Each sample holds `mp4` (H.264, the
format of `data.sources.video` shards; default) and/or `npy` (lossless uint8 (T, H, W, 3) frames,
`--raw-frames` / `--format both`), `txt` and `json` (frames, fps, height, width, duration, codec and
the start/end centre and radius of the shape). Same held-out (shape, colour) split as images.
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import os
import sys
import time
from fractions import Fraction

import numpy as np
import webdataset as wds
from PIL import Image
from tqdm import tqdm

from data import shapes as S

SPLITS = ("train", "heldout")
_SPLIT_CODE = {"train": 0, "heldout": 1}
MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_RADIUS_JITTER = 0.08  # relative; small enough that size names never overlap
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


def _article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def caption(attrs: dict, template: int) -> str:
    """Fill template `template` with a sample's attributes."""
    pos = S.POSITIONS[attrs["position"]][2]
    text = TEMPLATES[template].format(
        colour=attrs["colour"],
        a_colour=_article(attrs["colour"]),
        shape=attrs["shape"],
        size=attrs["size"],
        a_size=_article(attrs["size"]),
        background=attrs["background"],
        position=pos,
    )
    return text


def sample_attrs(split: str, index: int, seed: int, size_px: int) -> dict:
    """Attributes and caption of sample `index` of `split`; depends on nothing else.

    Per-sample generators make a sample independent of `count` and of generation order, so a
    larger dataset extends a smaller one and generation could be split across processes.
    """
    rng = np.random.default_rng([seed, _SPLIT_CODE[split], index])
    combos = S.train_combos() if split == "train" else S.HELDOUT_COMBOS
    shape, colour = combos[rng.integers(len(combos))]
    background = list(S.BACKGROUNDS)[rng.integers(len(S.BACKGROUNDS))]
    size_name = list(S.SIZES)[rng.integers(len(S.SIZES))]
    pos_name = list(S.POSITIONS)[rng.integers(len(S.POSITIONS))]
    radius = S.SIZES[size_name] * (1.0 + rng.uniform(-_RADIUS_JITTER, _RADIUS_JITTER))
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


def encode_png(img: np.ndarray) -> bytes:
    buf = io.BytesIO()
    # Fixed compress level and no optimize pass: the bytes depend on the pixels only.
    Image.fromarray(img).save(buf, format="PNG", compress_level=6, optimize=False)
    return buf.getvalue()


def make_sample(split: str, index: int, seed: int, size_px: int) -> dict:
    """One WebDataset sample dict (all values bytes/str), ready for a ShardWriter."""
    attrs = sample_attrs(split, index, seed, size_px)
    return {
        "__key__": f"{split}-{index:08d}",
        "png": encode_png(render_sample(attrs)),
        "txt": attrs["caption"],
        "json": json.dumps(attrs, sort_keys=True).encode("utf-8"),
    }


def _write_split(out: str, split: str, count: int, size: int, shard_size: int, seed: int,
                 progress: bool, make=None) -> list[str]:  # fmt: skip
    """Write `count` samples of `split` as shards; `make(split, i)` builds sample i (default: image)."""
    if make is None:
        def make(sp, i):
            return make_sample(sp, i, seed, size)
    split_dir = os.path.join(out, split)
    os.makedirs(split_dir, exist_ok=True)
    # Stale shards from an earlier, larger run would silently join this dataset (the loader reads
    # every *.tar in the folder), so remove the files this generator owns before writing.
    for old in glob.glob(os.path.join(glob.escape(split_dir), "shard-*.tar")):
        os.remove(old)
    if count == 0:
        return []
    pattern = os.path.join(split_dir, "shard-%06d.tar")
    # mtime=0 and fixed owner make the tar headers reproducible; verbose=0 keeps stdout clean.
    writer = wds.ShardWriter(pattern, maxcount=shard_size, verbose=0, mtime=0.0)
    try:
        for i in tqdm(range(count), desc=split, unit="img", disable=not progress, leave=False):
            writer.write(make(split, i))
    finally:
        writer.close()
    n_shards = (count + shard_size - 1) // shard_size
    return [os.path.join(split, f"shard-{k:06d}.tar") for k in range(n_shards)]


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
    for name, v, lo in (("count", count, 0), ("heldout_count", heldout_count, 0),
                        ("size", size, 8), ("shard_size", shard_size, 1)):  # fmt: skip
        if int(v) != v or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    out = os.fspath(out)
    os.makedirs(out, exist_ok=True)
    manifest_path = os.path.join(out, MANIFEST)
    if os.path.exists(manifest_path):
        os.remove(manifest_path)  # absent until the new dataset is complete
    t0 = time.perf_counter()
    counts = {"train": int(count), "heldout": int(heldout_count)}
    shards = {sp: _write_split(out, sp, counts[sp], size, shard_size, seed, progress) for sp in SPLITS}
    manifest = {
        "format_version": FORMAT_VERSION,
        "args": {"count": count, "heldout_count": heldout_count, "size": size,
                 "shard_size": shard_size, "seed": seed},  # fmt: skip
        "counts": counts,
        "shards": shards,
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
    # Written last and without timestamps: it is the completion marker and part of the
    # reproducible output.
    tmp = manifest_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    os.replace(tmp, manifest_path)
    return {"out": out, **manifest, "seconds": round(time.perf_counter() - t0, 3)}


def load_manifest(out: str) -> dict | None:
    """The manifest of a complete dataset in `out`, or None when absent or unreadable."""
    try:
        with open(os.path.join(out, MANIFEST)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def ensure(out: str, **kwargs) -> dict:
    """Generate into `out` unless a complete dataset with the same arguments is already there.

    What a trainer's demo config calls: the first run pays the generation, later ones reuse it.
    """
    args = {"count": 20000, "heldout_count": 512, "size": 32, "shard_size": 1000, "seed": 0}
    progress = kwargs.pop("progress", False)
    unknown = set(kwargs) - set(args)
    if unknown:
        raise TypeError(f"unknown arguments {sorted(unknown)}; known: {sorted(args)}")
    args.update(kwargs)
    found = load_manifest(out)
    if found is not None and found.get("args") == args and found.get("format_version") == FORMAT_VERSION:
        return {"out": os.fspath(out), **found, "seconds": 0.0}
    return generate(out, progress=progress, **args)


# ---------------------------------------------------------------------------------------------
# Video mode: one shape moving (or growing/shrinking, or standing still) across a short clip.
# ---------------------------------------------------------------------------------------------

VIDEO_FORMAT_VERSION = 1
# Motion name -> caption phrases (the sample's rng picks one, so text encoders see synonyms).
MOTIONS: dict[str, tuple[str, ...]] = {
    "left_to_right": ("moving left to right", "moving to the right"),
    "right_to_left": ("moving right to left", "moving to the left"),
    "up": ("moving up", "moving from bottom to top"),
    "down": ("moving down", "moving from top to bottom"),
    "growing": ("growing", "getting bigger"),
    "shrinking": ("shrinking", "getting smaller"),
    "static": ("standing still", "not moving"),
}
VIDEO_FORMATS = ("mp4", "npy", "both")
# Every template names colour, shape and motion.
VIDEO_TEMPLATES: list[str] = [
    "{a_colour} {shape} {motion} on a {background} background",
    "{a_colour} {shape} {motion}",
    "a video of {a_colour} {shape} {motion}",
    "{background} background with {a_colour} {shape} {motion}",
    "a {shape} coloured {colour} {motion}",
    "a clip of {a_size} {colour} {shape} {motion} on {background}",
]
_TRAVEL = (0.6, 1.0)  # translation covers this fraction of the free room along its axis
_R_SMALL = (0.14, 0.16)  # growing/shrinking: radius at the small end ...
_R_LARGE = (0.25, 0.28)  # ... and at the large end (area ratio >= ~2.4)
_VIDEO_SPLIT_TAG = 1  # keeps video generators apart from image ones seeded alike


def video_caption(attrs: dict, template: int, phrase: int) -> str:
    size = attrs["size_start"] if attrs["motion"] != "growing" else attrs["size_end"]
    return VIDEO_TEMPLATES[template].format(
        colour=attrs["colour"], a_colour=_article(attrs["colour"]), shape=attrs["shape"],
        a_size=_article(size), background=attrs["background"],
        motion=MOTIONS[attrs["motion"]][phrase],
    )  # fmt: skip


def _size_name(radius: float) -> str:
    return min(S.SIZES, key=lambda k: abs(S.SIZES[k] - radius))


def video_attrs(split: str, index: int, seed: int, sizes=(32,), frames=(8,), fps: float = 8.0,
                motions=tuple(MOTIONS)) -> dict:  # fmt: skip
    """Attributes and caption of clip `index` of `split`; a pure function of the arguments.

    Geometry is in fractions of the side (as in image mode) and moves linearly from the start
    values (frame 0) to the end values (frame T-1); the shape keeps >= 1.5 px of background
    around it in every frame. Held-out clips use only `data.shapes.HELDOUT_COMBOS` (shape, colour)
    pairs, train clips never do; motion is drawn independently of the pair.
    """
    rng = np.random.default_rng([seed, _SPLIT_CODE[split], index, _VIDEO_SPLIT_TAG])
    combos = S.train_combos() if split == "train" else S.HELDOUT_COMBOS
    shape, colour = combos[rng.integers(len(combos))]
    background = list(S.BACKGROUNDS)[rng.integers(len(S.BACKGROUNDS))]
    motion = list(motions)[rng.integers(len(motions))]
    size_px = int(list(sizes)[rng.integers(len(sizes))])
    n_frames = int(list(frames)[rng.integers(len(frames))])
    margin = 1.5 / size_px
    if motion in ("growing", "shrinking"):
        r_small, r_large = rng.uniform(*_R_SMALL), rng.uniform(*_R_LARGE)
        lo, hi = r_large + margin, 1.0 - r_large - margin
        cx = cx1 = rng.uniform(lo, hi)
        cy = cy1 = rng.uniform(lo, hi)
        r0, r1 = (r_small, r_large) if motion == "growing" else (r_large, r_small)
    else:
        size_name = list(S.SIZES)[rng.integers(len(S.SIZES))]
        r0 = r1 = S.SIZES[size_name] * (1.0 + rng.uniform(-_RADIUS_JITTER, _RADIUS_JITTER))
        lo, hi = r0 + margin, 1.0 - r0 - margin
        room = hi - lo
        travel = 0.0 if motion == "static" else room * rng.uniform(*_TRAVEL)
        a0 = lo + rng.uniform(0.0, room - travel)  # start along the motion axis
        a1 = a0 + travel
        if motion in ("right_to_left", "up"):  # image y grows downwards: "up" is decreasing y
            a0, a1 = a1, a0
        other = rng.uniform(lo, hi)
        if motion in ("up", "down"):
            cx, cx1, cy, cy1 = other, other, a0, a1
        else:
            cx, cx1, cy, cy1 = a0, a1, other, other
    attrs = {
        "shape": shape, "colour": colour, "background": background, "motion": motion,
        "cx_start": round(float(cx), 6), "cy_start": round(float(cy), 6),
        "cx_end": round(float(cx1), 6), "cy_end": round(float(cy1), 6),
        "radius_start": round(float(r0), 6), "radius_end": round(float(r1), 6),
        "size_start": _size_name(r0), "size_end": _size_name(r1),
        "colour_rgb": list(S.COLOURS[colour]), "background_rgb": list(S.BACKGROUNDS[background]),
        "frames": n_frames, "fps": float(fps), "height": size_px, "width": size_px,
        "duration": round(n_frames / float(fps), 6),
        "split": split, "index": index, "seed": seed, "source": "synth",
    }  # fmt: skip
    attrs["template"] = int(rng.integers(len(VIDEO_TEMPLATES)))
    attrs["phrase"] = int(rng.integers(len(MOTIONS[motion])))
    attrs["caption"] = video_caption(attrs, attrs["template"], attrs["phrase"])
    return attrs


def frame_params(attrs: dict) -> list[tuple[float, float, float]]:
    """(cx, cy, radius) of every frame, fractions of the side: linear from start to end."""
    n = attrs["frames"]
    out = []
    for t in range(n):
        f = t / (n - 1) if n > 1 else 0.0
        out.append(tuple(attrs[f"{k}_start"] + (attrs[f"{k}_end"] - attrs[f"{k}_start"]) * f
                         for k in ("cx", "cy", "radius")))  # fmt: skip
    return out


def render_video(attrs: dict) -> np.ndarray:
    """The clip's frames, uint8 (T, H, W, 3)."""
    return np.stack([
        S.render(attrs["shape"], attrs["colour"], attrs["background"], cx, cy, r, attrs["height"])
        for cx, cy, r in frame_params(attrs)
    ])  # fmt: skip


def encode_npy(frames: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(frames, dtype=np.uint8), allow_pickle=False)
    return buf.getvalue()


def make_video_sample(split: str, index: int, seed: int, sizes=(32,), frames=(8,), fps: float = 8.0,
                      motions=tuple(MOTIONS), fmt: str = "mp4", crf: int = 23) -> dict:  # fmt: skip
    """One WebDataset clip sample: `mp4` and/or `npy` frames, `txt` caption, `json` attributes."""
    attrs = video_attrs(split, index, seed, sizes, frames, fps, motions)
    clip = render_video(attrs)
    sample = {"__key__": f"{split}-{index:08d}", "txt": attrs["caption"]}
    if fmt in ("mp4", "both"):
        from data.sources.video import encode_mp4  # shared with make_shards, byte-reproducible
        sample["mp4"], attrs["codec"] = encode_mp4(list(clip), fps, crf)
    else:
        attrs["codec"] = None
    if fmt in ("npy", "both"):
        sample["npy"] = encode_npy(clip)
    sample["json"] = json.dumps(attrs, sort_keys=True).encode("utf-8")
    return sample


def _int_list(v, name: str, lo: int) -> list[int]:
    vals = [v] if isinstance(v, (int, np.integer)) else list(v)
    if not vals or any(int(x) != x or x < lo for x in vals):
        raise ValueError(f"{name} must be integers >= {lo}, got {v!r}")
    return [int(x) for x in vals]


def generate_video(
    out: str,
    count: int = 5000,
    heldout_count: int = 256,
    size=(32,),
    frames=(8,),
    shard_size: int = 500,
    seed: int = 0,
    fps: float = 8.0,
    motions=tuple(MOTIONS),
    fmt: str = "mp4",
    crf: int = 23,
    progress: bool = False,
) -> dict:
    """Write the video dataset to `out`; return the summary (also written to out/manifest.json).

    size / frames: an int or a list; each clip draws one of each (so a list gives variable-size,
    variable-length clips for bucketed loading). fmt: "mp4" (H.264 clip, the format of real video
    shards), "npy" (lossless uint8 (T, H, W, 3) frames) or "both".
    """
    sizes = _int_list(size, "size", 16)
    frame_counts = _int_list(frames, "frames", 2)
    for name, v, lo in (("count", count, 0), ("heldout_count", heldout_count, 0),
                        ("shard_size", shard_size, 1)):  # fmt: skip
        if int(v) != v or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    if fmt not in VIDEO_FORMATS:
        raise ValueError(f"fmt must be one of {VIDEO_FORMATS}, got {fmt!r}")
    if fmt != "npy" and any(s % 2 for s in sizes):
        raise ValueError(f"mp4 (yuv420p) needs even sizes, got {sizes}")
    motions = list(motions)
    if not motions or any(m not in MOTIONS for m in motions):
        raise ValueError(f"motions must be from {list(MOTIONS)}, got {motions!r}")
    if not fps > 0:
        raise ValueError(f"fps must be > 0, got {fps!r}")
    out = os.fspath(out)
    os.makedirs(out, exist_ok=True)
    manifest_path = os.path.join(out, MANIFEST)
    if os.path.exists(manifest_path):
        os.remove(manifest_path)
    t0 = time.perf_counter()
    counts = {"train": int(count), "heldout": int(heldout_count)}

    def make(split, i):
        return make_video_sample(split, i, seed, sizes, frame_counts, fps, motions, fmt, crf)

    shards = {sp: _write_split(out, sp, counts[sp], 0, shard_size, seed, progress, make) for sp in SPLITS}
    from data.sources.video import _codec

    manifest = {
        "format_version": VIDEO_FORMAT_VERSION,
        "mode": "video",
        "args": {"count": count, "heldout_count": heldout_count, "size": sizes, "frames": frame_counts,
                 "shard_size": shard_size, "seed": seed, "fps": float(fps), "motions": motions,
                 "fmt": fmt, "crf": crf},  # fmt: skip
        "codec": _codec() if fmt != "npy" else None,
        "counts": counts,
        "shards": shards,
        "heldout_combos": [list(c) for c in S.HELDOUT_COMBOS],
        "vocabulary": {
            "shapes": S.SHAPES,
            "colours": {k: list(v) for k, v in S.COLOURS.items()},
            "backgrounds": {k: list(v) for k, v in S.BACKGROUNDS.items()},
            "sizes": S.SIZES,
            "motions": {k: list(v) for k, v in MOTIONS.items()},
            "templates": VIDEO_TEMPLATES,
        },
    }
    tmp = manifest_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    os.replace(tmp, manifest_path)
    return {"out": out, **manifest, "seconds": round(time.perf_counter() - t0, 3)}


def ensure_video(out: str, **kwargs) -> dict:
    """`ensure` for video mode: generate unless a complete video dataset with these args is there."""
    args = {"count": 5000, "heldout_count": 256, "size": [32], "frames": [8], "shard_size": 500,
            "seed": 0, "fps": 8.0, "motions": list(MOTIONS), "fmt": "mp4", "crf": 23}  # fmt: skip
    progress = kwargs.pop("progress", False)
    unknown = set(kwargs) - set(args)
    if unknown:
        raise TypeError(f"unknown arguments {sorted(unknown)}; known: {sorted(args)}")
    args.update(kwargs)
    args["size"], args["frames"] = _int_list(args["size"], "size", 16), _int_list(args["frames"], "frames", 2)
    args["motions"], args["fps"] = list(args["motions"]), float(args["fps"])
    found = load_manifest(out)
    if (found is not None and found.get("mode") == "video" and found.get("args") == args
            and found.get("format_version") == VIDEO_FORMAT_VERSION):  # fmt: skip
        return {"out": os.fspath(out), **found, "seconds": 0.0}
    return generate_video(out, progress=progress, **args)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m data.synth",
        description="Generate the synthetic shapes dataset (shape x colour x size x position x "
        "background) as WebDataset shards, with a held-out split of (shape, colour) pairs never "
        "seen in training. Same arguments -> byte-identical output. With --video: clips of one "
        "shape moving (left_to_right, right_to_left, up, down), growing, shrinking or static.",
    )
    p.add_argument("--out", required=True, help="output folder; gets train/, heldout/, manifest.json")
    p.add_argument("--count", type=int, default=None,
                   help="training samples (default 20000 images / 5000 clips)")
    p.add_argument("--heldout-count", type=int, default=None,
                   help="held-out samples, all from held-out (shape, colour) pairs (default 512 / 256)")
    p.add_argument("--size", type=int, default=32, help="image side in pixels, >= 8 (default 32)")
    p.add_argument("--shard-size", type=int, default=None,
                   help="samples per tar shard (default 1000 images / 500 clips)")
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
    return p


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    try:
        if a.video:
            summary = generate_video(
                a.out, 5000 if a.count is None else a.count,
                256 if a.heldout_count is None else a.heldout_count,
                _ints(a.sizes) if a.sizes else [a.size], _ints(a.frames),
                500 if a.shard_size is None else a.shard_size, a.seed, a.fps,
                [m.strip() for m in a.motions.split(",") if m.strip()],
                "npy" if a.raw_frames else a.fmt, a.crf, progress=not a.no_progress,
            )  # fmt: skip
        else:
            summary = generate(a.out, 20000 if a.count is None else a.count,
                               512 if a.heldout_count is None else a.heldout_count, a.size,
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
