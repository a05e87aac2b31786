"""Synthetic 3-D mode of the shapes dataset: one coloured primitive per sample, for text-to-3D.

    python -m data.synth --3d --out DIR [--count 8000 --heldout-count 448 --points 2048
                                         --occupancy 2048 --seed 0]          (or generate_3d)

Each sample is one primitive of `data/shapes3d.py` (sphere, cube, cylinder, cone, torus, pyramid,
capsule) x colour x size x aspect x position, in the shared scene frame [-0.5, 0.5]^3 (z up; not
re-normalised per shape, so size and position are part of the sample). Sample keys:

    __key__  "{split}-{index:08d}"
    npy      float16 (P, 6): xyz + rgb in [0, 1], P points sampled uniformly by area from
             `shapes3d.build_mesh` (the colour jittered by a few /255 per sample)
    occ.npy  float16 (Q, 7): xyz, occupancy {0, 1}, rgb; the layout of `make_shards meshes`
             (`data.sources.mesh.occupancy_queries`): Q/2 near-surface, Q/2 uniform in
             [-0.55, 0.55]^3; labels from the analytic `shapes3d.sdf` (< 0 inside). Absent with Q = 0.
    txt      caption naming colour and shape, mostly also size, aspect and position
    json     {"shape", "colour", "size", "aspect" (None for sphere / torus), "position", "params"
              (`shapes3d.primitive`), "points", "occupancy", "rgb", "caption", "template", ...}

The held-out split holds only the (shape, colour) pairs of `shapes3d.HELDOUT_COMBOS3D`, which never
occur in train. Output is a pure function of the arguments (per-sample generators seeded by (seed,
split, index), tar mtime 0), as in the other modes (data/synth_common.py).
"""

from __future__ import annotations

import io
import json
import re

import numpy as np

from data import shapes3d as S3
from data.synth_common import SPLIT_CODE, article, check_at_least, reuse_or_generate, write_dataset

FORMAT_VERSION_3D = 1
_3D_SPLIT_TAG = 3  # image mode seeds with [seed, split, index], video appends 1, VQA 2
_MARGIN = 0.01  # the bounding box keeps this far from the scene box's faces

# "@" stands for the article of the next word; an empty aspect leaves no gap. Every template names
# colour and shape; all but the first two also size, aspect and position.
TEMPLATES3D: list[str] = [
    "@ {colour} {shape}",
    "@ {colour} {shape} {position}",
    "@ {size} {aspect} {colour} {shape} {position}",
    "@ {aspect} {colour} {shape} {position}, {size}",
    "a 3d model of @ {size} {aspect} {colour} {shape} {position}",
    "{position}, @ {size} {aspect} {colour} {shape}",
    "@ {size} {aspect} {shape} coloured {colour}, {position}",
    "there is @ {size} {aspect} {colour} {shape} {position}",
    "@ {colour} {shape}, {size} and {aspect}, {position}",
    "a {shape}: {size}, {aspect}, {colour}, {position}",
]


def caption_3d(attrs: dict, template: int) -> str:
    """Fill template `template` with a sample's attributes (no aspect for sphere and torus)."""
    aspect = attrs["aspect"] or ""
    text = TEMPLATES3D[template].format(colour=attrs["colour"], shape=attrs["shape"], size=attrs["size"],
                                        aspect=aspect, position=S3.POSITIONS3D[attrs["position"]][1])
    if not aspect:  # drop the aspect slot with its separators ("small, , red" / "small and ,")
        text = text.replace(" and ,", ",").replace(", ,", ",")
    text = re.sub(r" +", " ", text).replace(" ,", ",").strip()
    return re.sub(r"@ (\w+)", lambda m: article(m.group(1)), text)


def sample_attrs_3d(split: str, index: int, seed: int) -> dict:
    """Attributes and caption of sample `index` of `split`; depends on nothing else."""
    rng = np.random.default_rng([seed, SPLIT_CODE[split], index, _3D_SPLIT_TAG])
    combos = S3.train_combos3d() if split == "train" else S3.HELDOUT_COMBOS3D
    shape, colour = combos[rng.integers(len(combos))]
    size = list(S3.SIZES3D)[rng.integers(len(S3.SIZES3D))]
    aspects = list(S3.ASPECTS3D[shape])
    aspect = aspects[rng.integers(len(aspects))] if aspects else None
    position = list(S3.POSITIONS3D)[rng.integers(len(S3.POSITIONS3D))]
    max_extent = S3.SIZES3D[size] * (1.0 + rng.uniform(-S3.SIZE_JITTER, S3.SIZE_JITTER))
    ratio = S3.ASPECTS3D[shape][aspect] * (1.0 + rng.uniform(-S3.ASPECT_JITTER, S3.ASPECT_JITTER)) if aspect else None
    width, _ = S3.box_size(shape, max_extent, ratio)
    room = 0.5 - _MARGIN - width / 2  # a large shape at the side is pulled in a little, never clipped
    x = float(np.clip(S3.POSITIONS3D[position][0] + rng.uniform(-S3.POSITION_JITTER, S3.POSITION_JITTER), -room, room))
    rgb = np.clip(np.asarray(S3.COLOURS[colour]) + rng.integers(-S3.COLOUR_JITTER, S3.COLOUR_JITTER + 1, 3), 0, 255)
    attrs = {
        "shape": shape, "colour": colour, "size": size, "aspect": aspect, "position": position,
        "max_extent": round(float(max_extent), 6), "ratio": None if ratio is None else round(float(ratio), 6),
        "center": [round(x, 6), 0.0, 0.0], "rgb": [int(v) for v in rgb],
        "split": split, "index": index, "seed": seed, "source": "synth",
    }  # fmt: skip
    attrs["params"] = S3.primitive(attrs)
    attrs["template"] = int(rng.integers(len(TEMPLATES3D)))
    attrs["caption"] = caption_3d(attrs, attrs["template"])
    return attrs


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def sample_arrays_3d(attrs: dict, points: int = 2048, occupancy: int = 2048) -> tuple[np.ndarray, np.ndarray | None]:
    """(cloud float16 (P, 6), occupancy float16 (Q, 7) or None) of a sample's attributes."""
    import trimesh

    from data.sources.mesh import occupancy_queries

    # A stream of its own: the attributes stay the same whatever P and Q are.
    rng = np.random.default_rng([attrs["seed"], SPLIT_CODE[attrs["split"]], attrs["index"], _3D_SPLIT_TAG, 1])
    mesh = S3.build_mesh(attrs)
    xyz, faces = trimesh.sample.sample_surface(mesh, points, seed=int(rng.integers(2**31)))
    rgb = np.asarray(mesh.visual.face_colors, dtype=np.float64)[faces, :3] / 255.0
    surface = np.column_stack([xyz, rgb])
    occ = None
    if occupancy:
        shape, theta = attrs["shape"], S3.params_to_theta(attrs["shape"], attrs["params"])[None]
        occ = occupancy_queries(surface, occupancy, rng, lambda q: S3.sdf_theta(shape, theta, q)[0] < 0)
    return surface.astype(np.float16), occ


def make_sample_3d(split: str, index: int, seed: int, points: int = 2048, occupancy: int = 2048) -> dict:
    """One WebDataset sample: `npy` cloud, `occ.npy` occupancy (when occupancy > 0), `txt`, `json`."""
    attrs = sample_attrs_3d(split, index, seed)
    cloud, occ = sample_arrays_3d(attrs, points, occupancy)
    attrs.update(points=points, occupancy=occupancy)
    sample = {"__key__": f"{split}-{index:08d}", "npy": _npy(cloud), "txt": attrs["caption"]}
    if occ is not None:
        sample["occ.npy"] = _npy(occ)
    sample["json"] = json.dumps(attrs, sort_keys=True).encode("utf-8")
    return sample


def generate_3d(
    out: str,
    count: int = 8000,
    heldout_count: int = 448,
    points: int = 2048,
    occupancy: int = 2048,
    shard_size: int = 1000,
    seed: int = 0,
    progress: bool = False,
) -> dict:
    """Write the 3-D dataset to `out`; return the summary (also written to out/manifest.json)."""
    check_at_least(("count", count, 0), ("heldout_count", heldout_count, 0), ("points", points, 1),
                   ("occupancy", occupancy, 0), ("shard_size", shard_size, 1))  # fmt: skip

    def make(split, i):
        return make_sample_3d(split, i, seed, points, occupancy)

    manifest = {
        "format_version": FORMAT_VERSION_3D,
        "mode": "3d",
        "args": {"count": count, "heldout_count": heldout_count, "points": points, "occupancy": occupancy,
                 "shard_size": shard_size, "seed": seed},  # fmt: skip
        "heldout_combos": [list(c) for c in S3.HELDOUT_COMBOS3D],
        "vocabulary": {
            "shapes": S3.SHAPES3D,
            "colours": {k: list(v) for k, v in S3.COLOURS.items()},
            "sizes": S3.SIZES3D,
            "aspects": S3.ASPECTS3D,
            "positions": {k: v[0] for k, v in S3.POSITIONS3D.items()},
            "torus_tube": S3.TORUS_TUBE,
            "templates": TEMPLATES3D,
        },
    }
    return write_dataset(out, count, heldout_count, shard_size, make, manifest, progress)


def ensure_3d(out: str, **kwargs) -> dict:
    """`ensure` for 3-D mode: generate unless a complete 3-D dataset with these args is there."""
    defaults = {"count": 8000, "heldout_count": 448, "points": 2048, "occupancy": 2048, "shard_size": 1000,
                "seed": 0}  # fmt: skip
    return reuse_or_generate(out, defaults, kwargs, generate_3d, format_version=FORMAT_VERSION_3D, mode="3d")
