"""Synthetic video mode of the shapes dataset: one shape moving across a short clip.

    python -m data.synth --video --out DIR [--frames 8,12,16] [--sizes 32,48]   (or generate_video)

Clips of one shape moving left_to_right / right_to_left / up / down, growing,
shrinking or static, captioned with colour, shape and motion. Each sample holds `mp4` (H.264, the
format of `data.sources.video` shards; default) and/or `npy` (lossless uint8 (T, H, W, 3) frames,
`--raw-frames` / `--format both`), `txt` and `json` (frames, fps, height, width, duration, codec and
the start/end centre and radius of the shape). Same held-out (shape, colour) split as images.

Shares the image mode's splits, held-out (shape, colour) pairs, shard writer and manifest rules
(data/synth_common.py); output is again a pure function of the arguments.
"""
from __future__ import annotations

import io
import json

import numpy as np

from data import shapes as S
from data.synth_common import RADIUS_JITTER, SPLIT_CODE, article, check_at_least, reuse_or_generate, write_dataset

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
# Each motion but "static" and the one that reverses it (phrases are parallel: index i of one is
# the reversal of index i of the other).
OPPOSITE_MOTION: dict[str, str] = {"left_to_right": "right_to_left", "right_to_left": "left_to_right",
                                   "up": "down", "down": "up", "growing": "shrinking", "shrinking": "growing"}
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
        colour=attrs["colour"], a_colour=article(attrs["colour"]), shape=attrs["shape"],
        a_size=article(size), background=attrs["background"],
        motion=MOTIONS[attrs["motion"]][phrase],
    )  # fmt: skip


def reverse_motion(caption: str, attrs: dict) -> tuple[str, str] | None:
    """(the caption with its motion phrase replaced by the opposite motion's, that motion), from a
    clip's caption and attributes; None for a static clip or a caption that lacks its phrase."""
    motion, phrase = attrs.get("motion"), attrs.get("phrase")
    if motion not in OPPOSITE_MOTION or phrase is None:
        return None
    opposite = OPPOSITE_MOTION[motion]
    old, new = MOTIONS[motion][phrase], MOTIONS[opposite][phrase]
    if old not in caption:
        return None
    return caption.replace(old, new, 1), opposite


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
    rng = np.random.default_rng([seed, SPLIT_CODE[split], index, _VIDEO_SPLIT_TAG])
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
        r0 = r1 = S.SIZES[size_name] * (1.0 + rng.uniform(-RADIUS_JITTER, RADIUS_JITTER))
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
        # Lazy: common.data imports torch, which npy clips and image mode never need.
        from common.data.media import encode_mp4  # the shard writer's byte-reproducible encoder
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
    check_at_least(("count", count, 0), ("heldout_count", heldout_count, 0), ("shard_size", shard_size, 1))
    if fmt not in VIDEO_FORMATS:
        raise ValueError(f"fmt must be one of {VIDEO_FORMATS}, got {fmt!r}")
    if fmt != "npy" and any(s % 2 for s in sizes):
        raise ValueError(f"mp4 (yuv420p) needs even sizes, got {sizes}")
    motions = list(motions)
    if not motions or any(m not in MOTIONS for m in motions):
        raise ValueError(f"motions must be from {list(MOTIONS)}, got {motions!r}")
    if not fps > 0:
        raise ValueError(f"fps must be > 0, got {fps!r}")

    def make(split, i):
        return make_video_sample(split, i, seed, sizes, frame_counts, fps, motions, fmt, crf)

    codec = None
    if fmt != "npy":
        from common.data.media import mp4_codec  # lazy, as in make_video_sample

        codec = mp4_codec()
    manifest = {
        "format_version": VIDEO_FORMAT_VERSION,
        "mode": "video",
        "args": {"count": count, "heldout_count": heldout_count, "size": sizes, "frames": frame_counts,
                 "shard_size": shard_size, "seed": seed, "fps": float(fps), "motions": motions,
                 "fmt": fmt, "crf": crf},  # fmt: skip
        "codec": codec,
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
    return write_dataset(out, count, heldout_count, shard_size, make, manifest, progress)


def ensure_video(out: str, **kwargs) -> dict:
    """`ensure` for video mode: generate unless a complete video dataset with these args is there."""
    defaults = {"count": 5000, "heldout_count": 256, "size": [32], "frames": [8], "shard_size": 500,
                "seed": 0, "fps": 8.0, "motions": list(MOTIONS), "fmt": "mp4", "crf": 23}  # fmt: skip

    def as_recorded(args: dict) -> dict:  # the manifest stores lists and a float fps
        return {**args, "size": _int_list(args["size"], "size", 16), "frames": _int_list(args["frames"], "frames", 2),
                "motions": list(args["motions"]), "fps": float(args["fps"])}

    return reuse_or_generate(out, defaults, kwargs, generate_video, format_version=VIDEO_FORMAT_VERSION, mode="video",
                             normalise=as_recorded)
