"""Read back, from pixels alone, which colour and which shape a synthetic image shows.

The automatic judge for text-to-image samples on the shapes dataset: generate "a red star", run
`analyse`, check the answer. It knows the vocabulary and the exact renderer (`data.shapes`), so on
clean renders it is near-perfect, and on a model's imperfect output it degrades to "not sure"
(None) rather than to a confident wrong answer or an exception.

Method:
  background  median of the 1-pixel border (shapes never touch it), nearest BACKGROUNDS entry
  foreground  pixels whose RGB distance to the background exceeds a threshold above the border noise
  colour      median of the strongest foreground pixels, nearest COLOURS entry
  coverage    per-pixel fraction of foreground, by projecting onto the background->colour line
              (undoes the renderer's antialiasing blend)
  shape       for each candidate, the (cx, cy, r) that reproduces the coverage's area and centroid
              (from `shapes.shape_moments`), rendered and compared by soft IoU; a small local
              search refines the best few; the best IoU wins
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from data import shapes as S

BACKGROUND_TOL = 60.0  # RGB distance beyond which the background is none of ours
COLOUR_TOL = 70.0  # beyond this the colour is "none of the palette"; half-gap of neighbours is ~44
FG_MIN_DIFF = 40.0  # smallest RGB distance from the background that counts as foreground
SHAPE_MIN_IOU = 0.6  # clean renders score >= ~0.9; below this the blob is not one of our shapes
_MIN_FG_PIXELS = 4.0  # coverage area (pixels) below which there is no shape to speak of
_ALPHA_FLOOR = 0.12  # coverage below this is treated as noise

_PALETTE_NAMES = list(S.COLOURS)
_PALETTE = np.array([S.COLOURS[c] for c in _PALETTE_NAMES], dtype=np.float64)
_BG_NAMES = list(S.BACKGROUNDS)
_BG = np.array([S.BACKGROUNDS[b] for b in _BG_NAMES], dtype=np.float64)


def _as_rgb(img) -> np.ndarray | None:
    """Best-effort float64 HxWx3 in 0..255 from whatever a caller hands over; None if hopeless."""
    try:
        a = np.asarray(img)
    except Exception:
        return None
    if a.dtype == object or a.size == 0:
        return None
    is_float = a.dtype.kind == "f"
    if a.ndim == 3 and a.shape[0] in (1, 3, 4) and a.shape[2] not in (1, 3, 4):
        a = np.moveaxis(a, 0, -1)  # CHW tensors straight from a model
    if a.ndim == 2:
        a = a[..., None]
    if a.ndim != 3 or a.shape[0] < 3 or a.shape[1] < 3:
        return None
    if a.shape[2] == 1:
        a = np.repeat(a, 3, axis=2)
    a = a[..., :3].astype(np.float64)
    if not np.isfinite(a).all():
        a = np.nan_to_num(a, nan=0.0, posinf=255.0, neginf=0.0)
    if is_float and a.max(initial=0) <= 1.0:
        a = a * 255.0  # float images in [0, 1]
    return np.clip(a, 0.0, 255.0)


def _nearest(rgb: np.ndarray, table: np.ndarray, names: list[str]) -> tuple[str, float]:
    d = np.linalg.norm(table - rgb[None, :], axis=1)
    i = int(np.argmin(d))
    return names[i], float(d[i])


def _soft_iou(a: np.ndarray, m: np.ndarray) -> float:
    union = np.maximum(a, m).sum()
    return float(np.minimum(a, m).sum() / union) if union > 0 else 0.0


def _mask(shape: str, cx: float, cy: float, r: float, h: int, w: int) -> np.ndarray:
    # render_mask draws square canvases in fractions of the side; crop for non-square inputs.
    n = max(h, w)
    return S.render_mask(shape, cx / n, cy / n, r / n, n)[:h, :w]


def _fit(shape: str, alpha: np.ndarray, area: float, mx: float, my: float) -> tuple[float, tuple]:
    """Moment-matched placement of `shape` and its IoU with the coverage map."""
    k, dx, dy = S.shape_moments(shape)
    r = float(np.sqrt(area / k))
    cx, cy = mx - dx * r, my - dy * r
    h, w = alpha.shape
    return _soft_iou(alpha, _mask(shape, cx, cy, r, h, w)), (cx, cy, r)


def _refine(shape: str, alpha: np.ndarray, iou: float, p: tuple) -> tuple[float, tuple]:
    """Coordinate search around a placement; moments are biased when the coverage is noisy."""
    h, w = alpha.shape
    best, (cx, cy, r) = iou, p
    for step in (0.5, 0.25):
        improved = True
        while improved:
            improved = False
            for cand in ((cx + step, cy, r), (cx - step, cy, r), (cx, cy + step, r),
                         (cx, cy - step, r), (cx, cy, r + step), (cx, cy, max(0.5, r - step))):  # fmt: skip
                v = _soft_iou(alpha, _mask(shape, *cand, h, w))
                if v > best + 1e-9:
                    best, (cx, cy, r), improved = v, cand, True
    return best, (cx, cy, r)


def analyse(img) -> dict:
    """Which colour, shape and background `img` (uint8 HxWx3; floats, grey, RGBA, CHW tolerated) shows.

    Returns a dict with:
      colour, shape, background   names from data.shapes, or None when not recognisable
      colour_guess, shape_guess   the nearest candidate even when not confident
      colour_distance             RGB distance of the measured colour to the named one
      shape_iou, shape_scores     soft IoU of the best / every candidate with the foreground
      cx, cy, radius              best placement, fractions of the image side
      fg_fraction                 share of the image covered by the foreground
      confident                   colour and shape both recognised
    Never raises on odd pixels: a blank or pure-noise image yields None for colour and shape.
    """
    out = {
        "colour": None, "shape": None, "background": None, "colour_guess": None,
        "shape_guess": None, "colour_rgb": None, "colour_distance": None,
        "background_rgb": None, "shape_iou": 0.0, "shape_scores": {}, "cx": None, "cy": None,
        "radius": None, "fg_fraction": 0.0, "confident": False,
    }  # fmt: skip
    a = _as_rgb(img)
    if a is None:
        return out
    h, w, _ = a.shape
    border = np.concatenate([a[0], a[-1], a[1:-1, 0], a[1:-1, -1]])
    bg = np.median(border, axis=0)
    bg_name, bg_dist = _nearest(bg, _BG, _BG_NAMES)
    out["background_rgb"] = [round(float(v), 1) for v in bg]
    out["background"] = bg_name if bg_dist <= BACKGROUND_TOL else None

    diff = np.linalg.norm(a - bg, axis=2)
    # Generated images have noisy backgrounds: stay well above the noise seen on the border.
    noise = float(np.percentile(np.linalg.norm(border - bg, axis=1), 90))
    fg = diff > max(FG_MIN_DIFF, 3.0 * noise)
    out["fg_fraction"] = float(fg.mean())
    if fg.sum() < _MIN_FG_PIXELS:
        return out

    # Colour from the most saturated pixels: edge pixels are blends with the background.
    strong = fg & (diff >= 0.85 * np.percentile(diff[fg], 90))
    rgb = np.median(a[strong], axis=0)
    c_name, c_dist = _nearest(rgb, _PALETTE, _PALETTE_NAMES)
    out.update(colour_guess=c_name, colour_distance=round(c_dist, 2),
               colour_rgb=[round(float(v), 1) for v in rgb])  # fmt: skip
    out["colour"] = c_name if c_dist <= COLOUR_TOL else None

    # Coverage: the renderer blends bg*(1-alpha) + fg*alpha, so projecting onto bg->fg inverts it.
    v = rgb - bg
    alpha = np.clip(((a - bg) @ v) / max(float(v @ v), 1e-6), 0.0, 1.0)
    alpha[alpha < _ALPHA_FLOOR] = 0.0
    area = float(alpha.sum())
    if area < _MIN_FG_PIXELS:
        out["colour"] = None
        return out
    ys, xs = np.mgrid[0:h, 0:w]
    mx = float((alpha * (xs + 0.5)).sum() / area)  # pixel i spans [i, i+1)
    my = float((alpha * (ys + 0.5)).sum() / area)

    fits = {s: _fit(s, alpha, area, mx, my) for s in S.SHAPES}
    # Refine only the two front-runners, and only when the moment fit leaves doubt: on clean
    # renders it is already within a hair of the truth and a search would only cost time.
    ranked = sorted(fits, key=lambda s: -fits[s][0])
    if fits[ranked[0]][0] < 0.9 or fits[ranked[0]][0] - fits[ranked[1]][0] < 0.1:
        for s in ranked[:2]:
            if fits[s][0] > 0.3:
                fits[s] = _refine(s, alpha, *fits[s])
    best = max(S.SHAPES, key=lambda s: fits[s][0])
    iou, (cx, cy, r) = fits[best]
    n = max(h, w)
    out.update(
        shape_guess=best, shape_iou=round(iou, 4),
        shape_scores={s: round(fits[s][0], 4) for s in S.SHAPES},
        cx=round(cx / n, 4), cy=round(cy / n, 4), radius=round(r / n, 4),
    )  # fmt: skip
    out["shape"] = best if iou >= SHAPE_MIN_IOU else None
    out["confident"] = out["shape"] is not None and out["colour"] is not None
    return out


def score(images: Iterable, attrs: Sequence[dict]) -> dict:
    """Accuracy of `analyse` against the intended attributes (dicts with "colour" and "shape"),
    and `drawn`: how often each shape was recognised ("none": not recognisable), which tells a
    model that ignores the shape word (one shape for every prompt) from one that draws poorly.

    A None answer counts as wrong: an unrecognisable sample is a failed sample.
    """
    n = colour_ok = shape_ok = both_ok = 0
    drawn: dict[str, int] = {}
    for img, want in zip(images, attrs, strict=True):
        got = analyse(img)
        c = got["colour"] is not None and got["colour"] == want["colour"]
        s = got["shape"] is not None and got["shape"] == want["shape"]
        n += 1
        colour_ok += c
        shape_ok += s
        both_ok += c and s
        key = got["shape"] or "none"
        drawn[key] = drawn.get(key, 0) + 1
    if n == 0:
        return {"colour_acc": 0.0, "shape_acc": 0.0, "both_acc": 0.0, "n": 0, "drawn": {}}
    return {"colour_acc": colour_ok / n, "shape_acc": shape_ok / n, "both_acc": both_ok / n, "n": n,
            "drawn": dict(sorted(drawn.items(), key=lambda kv: (-kv[1], kv[0])))}


def drawn_summary(drawn: dict[str, int], top: int = 3) -> str:
    """'circle 61%, square 20%, none 9%': the most recognised shapes of a `score` result."""
    total = sum(drawn.values()) or 1
    return ", ".join(f"{k} {v / total:.0%}" for k, v in list(drawn.items())[:top])


def mean_pairwise_distance(images: Sequence) -> float:
    """Mean RMS pixel distance (0..255) over every pair of `images` (HxWx3 each, as `analyse`
    takes them): how spread out a set of images is. ValueError with fewer than 2 usable images."""
    rgb = [a for a in (_as_rgb(img) for img in images) if a is not None]
    if len(rgb) < 2 or len({a.shape for a in rgb}) != 1:
        raise ValueError(f"mean_pairwise_distance needs >= 2 images of one size, got {len(rgb)} usable")
    flat = np.stack(rgb).reshape(len(rgb), -1)
    sq = (flat * flat).sum(1)
    d2 = (sq[:, None] + sq[None, :] - 2.0 * flat @ flat.T) / flat.shape[1]
    upper = np.triu_indices(len(rgb), 1)
    return float(np.sqrt(np.maximum(d2[upper], 0.0)).mean())


# Below this mean pairwise distance (pixel units, 0..255) a set of images counts as all alike:
# the distance comes from a Gram matrix, so identical non-integer images give rounding noise
# (~1e-6 after the square root), not exactly 0; real classes spread by tens of levels.
MIN_SPREAD = 1e-3


def diversity_ratio(generated: Sequence, real: Sequence) -> float:
    """Spread of one prompt's samples over that of real images of its class (1: as varied as the
    data, near 0: the same image every time). ValueError when the real images do not differ at
    all: there is no spread to compare against."""
    real_spread = mean_pairwise_distance(real)
    if real_spread <= MIN_SPREAD:
        raise ValueError(f"diversity_ratio: the {len(real)} real images are all identical (zero spread), "
                         "so no ratio can be formed; give real images that differ")
    return mean_pairwise_distance(generated) / real_spread
