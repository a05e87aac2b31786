"""Vocabulary and renderer of the synthetic shapes dataset.

Everything that defines what a synthetic image can show lives here, so the generator
(`data/synth.py`), the pixel analyser (`data/shape_analysis.py`) and any evaluation agree by
construction. Geometry is given in fractions of the image side, so one set of attributes renders
at any resolution (the same sample can feed a 32 px and a 256 px model).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

# Upright, filled shapes. Each one spans the box [cx-r, cx+r] x [cy-r, cy+r] (the star is scaled
# to the box height and centred in it, so it is ~5% wider): "radius" then means the same visual
# extent for every shape, and shapes differ in outline, not in size. Diamond is a square turned
# 45 degrees; its IoU with the square of the same box is 0.5, so it stays distinguishable at 32 px.
SHAPES: list[str] = ["circle", "square", "triangle", "star", "cross", "diamond"]

# Saturated colours, pairwise RGB distance >= ~100, each far from every background.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (225, 30, 30),
    "green": (40, 200, 50),
    "blue": (50, 90, 245),
    "yellow": (245, 225, 40),
    "magenta": (225, 45, 225),
    "cyan": (40, 215, 225),
    "orange": (250, 140, 20),
    "white": (245, 245, 245),
}

# Dark, low-saturation backgrounds: every colour above stays >= ~145 RGB units away from each.
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "black": (0, 0, 0),
    "dark grey": (60, 60, 60),
    "navy": (15, 22, 70),
    "dark green": (14, 52, 26),
}

# Radius as a fraction of the image side. Small is ~9 px wide at 32 px: the smallest size at which
# a star's points and a triangle's corners still survive antialiasing.
SIZES: dict[str, float] = {"small": 0.14, "medium": 0.20, "large": 0.27}

# Named 3x3 grid positions: (centre x, centre y) as fractions, and the caption phrase.
POSITIONS: dict[str, tuple[float, float, str]] = {
    "top left": (0.27, 0.27, "in the top left"),
    "top": (0.50, 0.27, "at the top"),
    "top right": (0.73, 0.27, "in the top right"),
    "left": (0.27, 0.50, "on the left"),
    "centre": (0.50, 0.50, "in the centre"),
    "right": (0.73, 0.50, "on the right"),
    "bottom left": (0.27, 0.73, "in the bottom left"),
    "bottom": (0.50, 0.73, "at the bottom"),
    "bottom right": (0.73, 0.73, "in the bottom right"),
}

# (shape, colour) pairs that never occur in the training split: the held-out split measures
# compositional generalisation. Each colour is held out exactly once, and each shape with at most
# two colours, so every shape and every colour is still seen in training with other partners.
HELDOUT_COMBOS: list[tuple[str, str]] = [
    ("circle", "magenta"),
    ("square", "orange"),
    ("triangle", "blue"),
    ("star", "red"),
    ("cross", "yellow"),
    ("diamond", "cyan"),
    ("circle", "white"),
    ("triangle", "green"),
]

_STAR_INNER = 0.45  # inner/outer radius: fat enough that the star is not a few stray pixels


def train_combos() -> list[tuple[str, str]]:
    held = set(HELDOUT_COMBOS)
    return [(s, c) for s in SHAPES for c in COLOURS if (s, c) not in held]


def _rgb(c: str | tuple[int, int, int], table: dict[str, tuple[int, int, int]]) -> np.ndarray:
    if isinstance(c, str):
        if c not in table:
            raise ValueError(f"unknown colour {c!r}; known: {sorted(table)}")
        c = table[c]
    return np.asarray(c, dtype=np.float32)


def _polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    """Vertices in pixel units for the polygonal shapes."""
    if shape == "square":
        return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "diamond":
        return [(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)]
    if shape == "triangle":
        return [(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "cross":
        a = 0.36 * r  # half arm width
        return [
            (cx - a, cy - r), (cx + a, cy - r), (cx + a, cy - a), (cx + r, cy - a),
            (cx + r, cy + a), (cx + a, cy + a), (cx + a, cy + r), (cx - a, cy + r),
            (cx - a, cy + a), (cx - r, cy + a), (cx - r, cy - a), (cx - a, cy - a),
        ]  # fmt: skip
    if shape == "star":
        # The lowest points sit at cos(36 deg) * r below the centre; shift so the box is centred.
        top, bottom = r, r * math.cos(math.pi / 5)
        scale = 2 * r / (top + bottom)
        dy = (top - bottom) / 2 * scale
        pts = []
        for k in range(10):
            rad = (r if k % 2 == 0 else r * _STAR_INNER) * scale
            ang = -math.pi / 2 + k * math.pi / 5
            pts.append((cx + rad * math.cos(ang), cy + dy + rad * math.sin(ang)))
        return pts
    raise ValueError(f"unknown shape {shape!r}; known: {SHAPES}")


def _inside(shape: str, x: np.ndarray, y: np.ndarray, cx: float, cy: float, r: float) -> np.ndarray:
    """Boolean inside-test of sample points (broadcast x against y)."""
    if shape == "circle":
        return (x - cx) ** 2 + (y - cy) ** 2 < r * r
    pts = _polygon(shape, cx, cy, r)
    inside = np.zeros(np.broadcast_shapes(x.shape, y.shape), dtype=bool)
    # Even-odd crossing rule: a horizontal ray from the point crosses the outline an odd number
    # of times iff the point is inside; handles the non-convex star and cross too.
    for (x1, y1), (x2, y2) in zip(pts, pts[1:] + pts[:1]):
        if y1 == y2:
            continue  # a horizontal edge is never crossed by a horizontal ray
        spans = (y1 > y) != (y2 > y)
        x_cross = x1 + (y - y1) * ((x2 - x1) / (y2 - y1))
        inside ^= spans & (x < x_cross)
    return inside


def render_mask(
    shape: str, cx: float, cy: float, radius: float, size_px: int, supersample: int = 4
) -> np.ndarray:
    """Coverage of each pixel by the shape, float32 HxW in [0, 1].

    Tests a regular grid of supersample x supersample points inside each pixel and averages them
    (a box filter), so each value is the covered fraction of that pixel. Points are tested
    analytically rather than drawn with PIL.ImageDraw, because ImageDraw floors vertex
    coordinates and fills both edge pixels, which shifts and grows shapes by up to a
    supersampled pixel and breaks the exact geometry the analyser relies on.
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {SHAPES}")
    s = max(1, int(supersample))
    n = int(size_px)
    # Pixel i covers [i, i+1) in pixel units; its samples sit at the centres of an s x s grid.
    t = (np.arange(n * s, dtype=np.float64) + 0.5) / s
    hit = _inside(shape, t[None, :], t[:, None], cx * n, cy * n, radius * n)
    return hit.reshape(n, s, n, s).mean(axis=(1, 3), dtype=np.float32)


def render(
    shape: str,
    colour: str | tuple[int, int, int],
    background: str | tuple[int, int, int],
    cx: float,
    cy: float,
    radius: float,
    size_px: int,
    supersample: int = 4,
) -> np.ndarray:
    """One antialiased shape on a flat background, uint8 HxWx3.

    cx, cy, radius are fractions of the image side; colour/background are names from COLOURS /
    BACKGROUNDS or RGB tuples. Deterministic: same arguments, same bytes.
    """
    alpha = render_mask(shape, cx, cy, radius, size_px, supersample)[..., None]
    fg, bg = _rgb(colour, COLOURS), _rgb(background, BACKGROUNDS)
    out = bg * (1.0 - alpha) + fg * alpha
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


@lru_cache(maxsize=None)
def shape_moments(shape: str) -> tuple[float, float, float]:
    """(area / r^2, centroid dx / r, centroid dy / r) of a shape, measured on a fine render.

    Lets the analyser turn a foreground's area and centroid into each candidate's (cx, cy, r)
    without a search.
    """
    n, r = 512, 0.4
    m = render_mask(shape, 0.5, 0.5, r, n, supersample=1).astype(np.float64)
    area = m.sum()
    ys, xs = np.mgrid[0:n, 0:n] + 0.5  # pixel centres
    mx, my = (m * xs).sum() / area, (m * ys).sum() / area
    rp = r * n
    return float(area / rp**2), float((mx - 0.5 * n) / rp), float((my - 0.5 * n) / rp)
