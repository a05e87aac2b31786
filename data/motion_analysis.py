"""Read back, from frames alone, which colour and shape a synthetic clip shows and how it moves.

The automatic judge for text-to-video samples on the synthetic video dataset (`data.synth`
video mode): generate "a red star moving left to right", run `analyse`, check the answer.

Method (deterministic, no learned parts):
  background  median of the 1-pixel border of every frame (shapes never touch it)
  coverage    per frame, foreground = pixels far from the background (threshold above the border
              noise); the colour is read from the strongest foreground pixels of all frames and
              the coverage is the projection onto the background->colour line (as in
              `data.shape_analysis`), which undoes antialiasing and most codec blur
  track       per frame: coverage area and centroid; frames with too little coverage are skipped
  motion      least-squares slopes over time of centroid x, y (fraction of the side) and of
              log(area), times (T - 1): the displacement and log area ratio from first to last
              frame. Translation score = |dominant displacement| / MOVE_THRESHOLD, scale score =
              |log area ratio| / SCALE_THRESHOLD; the larger one wins if it is >= 1, else "static"
  colour, shape  `data.shape_analysis.analyse` on the frame where the shape is largest (the most
              pixels, so the outline is clearest)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from data import shape_analysis as SA

MOTIONS = ("left_to_right", "right_to_left", "up", "down", "growing", "shrinking", "static")
MOVE_THRESHOLD = 0.1  # centroid displacement, fraction of the side; generated moves are >= ~0.2
SCALE_THRESHOLD = 0.35  # |log area ratio| (x1.42); generated growth is >= ~x2.4 (log 0.88)
_MIN_AREA = 4.0  # coverage pixels below which a frame has no shape to track


def _as_clip(frames) -> np.ndarray | None:
    """float64 (T, H, W, 3) in 0..255 from (T,H,W,3) / (T,3,H,W), uint8 / [0,1] / [-1,1]; None if hopeless."""
    try:
        a = np.asarray(frames.detach().cpu() if hasattr(frames, "detach") else frames)
    except Exception:
        return None
    if a.dtype == object or a.ndim != 4 or a.size == 0:
        return None
    if a.shape[1] in (1, 3, 4) and a.shape[3] not in (1, 3, 4):
        a = np.moveaxis(a, 1, -1)  # (T, C, H, W) straight from a model or decode_video
    if a.shape[3] == 1:
        a = np.repeat(a, 3, axis=3)
    is_float = a.dtype.kind == "f"
    a = np.nan_to_num(a[..., :3].astype(np.float64), nan=0.0, posinf=255.0, neginf=0.0)
    if is_float:
        if a.min(initial=0) < 0:
            a = (a + 1.0) * 127.5  # [-1, 1], the diffusion convention
        elif a.max(initial=0) <= 1.0:
            a = a * 255.0
    if a.shape[1] < 3 or a.shape[2] < 3:
        return None
    return np.clip(a, 0.0, 255.0)


def _slope(t: np.ndarray, v: np.ndarray) -> float:
    tc = t - t.mean()
    den = float((tc * tc).sum())
    return float((tc * (v - v.mean())).sum() / den) if den > 0 else 0.0


def analyse(frames) -> dict:
    """Colour, shape, background and motion of a clip.

    Returns a dict with:
      colour, shape, background   as `data.shape_analysis.analyse` on the largest frame (None: unsure)
      motion                      one of MOTIONS, or None when fewer than 2 frames show a shape
      dx, dy                      centroid displacement first->last frame (fit), fractions of the side
      log_area_ratio              log(area last / area first) (fit)
      centroids, areas            per frame (None where the frame shows no shape)
      key_frame                   index of the frame used for colour and shape
      confident                   colour, shape and motion all recognised
    Never raises on odd input.
    """
    out = {"colour": None, "shape": None, "background": None, "motion": None, "dx": 0.0, "dy": 0.0,
           "log_area_ratio": 0.0, "centroids": [], "areas": [], "key_frame": None,
           "confident": False}  # fmt: skip
    a = _as_clip(frames)
    if a is None:
        return out
    t_n, h, w, _ = a.shape
    n = max(h, w)
    border = np.concatenate([a[:, 0].reshape(-1, 3), a[:, -1].reshape(-1, 3),
                             a[:, 1:-1, 0].reshape(-1, 3), a[:, 1:-1, -1].reshape(-1, 3)])  # fmt: skip
    bg = np.median(border, axis=0)
    diff = np.linalg.norm(a - bg, axis=3)
    noise = float(np.percentile(np.linalg.norm(border - bg, axis=1), 90))
    fg = diff > max(SA.FG_MIN_DIFF, 3.0 * noise)
    if fg.sum() >= _MIN_AREA:
        strong = fg & (diff >= 0.85 * np.percentile(diff[fg], 90))
        v = np.median(a[strong], axis=0) - bg
        alpha = np.clip(((a - bg) @ v) / max(float(v @ v), 1e-6), 0.0, 1.0)
        alpha[alpha < SA._ALPHA_FLOOR] = 0.0
    else:
        alpha = np.zeros(a.shape[:3])
    ys, xs = np.mgrid[0:h, 0:w] + 0.5
    ts, cxs, cys, logs = [], [], [], []
    for t in range(t_n):
        area = float(alpha[t].sum())
        if area < _MIN_AREA:
            out["centroids"].append(None)
            out["areas"].append(None)
            continue
        cx, cy = float((alpha[t] * xs).sum() / area) / n, float((alpha[t] * ys).sum() / area) / n
        out["centroids"].append((round(cx, 4), round(cy, 4)))
        out["areas"].append(round(area, 2))
        ts.append(t)
        cxs.append(cx)
        cys.append(cy)
        logs.append(np.log(area))
    if not ts:
        out["background"] = SA.analyse(a[0])["background"]
        return out
    key = ts[int(np.argmax(logs))]
    still = SA.analyse(a[key])
    out.update(colour=still["colour"], shape=still["shape"], background=still["background"],
               key_frame=key)  # fmt: skip
    if len(ts) >= 2:
        t = np.asarray(ts, dtype=np.float64)
        span = t_n - 1
        dx, dy = _slope(t, np.asarray(cxs)) * span, _slope(t, np.asarray(cys)) * span
        lar = _slope(t, np.asarray(logs)) * span
        move = max(abs(dx), abs(dy)) / MOVE_THRESHOLD
        scale = abs(lar) / SCALE_THRESHOLD
        if max(move, scale) < 1.0:
            motion = "static"
        elif move >= scale:
            if abs(dx) >= abs(dy):
                motion = "left_to_right" if dx > 0 else "right_to_left"
            else:
                motion = "down" if dy > 0 else "up"  # image y grows downwards
        else:
            motion = "growing" if lar > 0 else "shrinking"
        out.update(motion=motion, dx=round(dx, 4), dy=round(dy, 4), log_area_ratio=round(lar, 4))
    out["confident"] = None not in (out["colour"], out["shape"], out["motion"])
    return out


def score(clips: Iterable, attrs: Sequence[dict] | None = None) -> dict:
    """Accuracy of `analyse` against intended attributes (dicts with colour, shape, motion).

    Either score(clips, attrs) or score(records) with records = iterable of (frames, attrs).
    A None answer counts as wrong. Also returns per-motion accuracy and the confusion of motions.
    """
    pairs = zip(clips, attrs, strict=True) if attrs is not None else clips
    n = c_ok = s_ok = m_ok = all_ok = 0
    per: dict[str, list[int]] = {}
    confusion: dict[str, dict[str, int]] = {}
    for frames, want in pairs:
        got = analyse(frames)
        c = got["colour"] is not None and got["colour"] == want["colour"]
        s = got["shape"] is not None and got["shape"] == want["shape"]
        m = got["motion"] is not None and got["motion"] == want["motion"]
        n += 1
        c_ok += c
        s_ok += s
        m_ok += m
        all_ok += c and s and m
        p = per.setdefault(want["motion"], [0, 0])
        p[0] += m
        p[1] += 1
        row = confusion.setdefault(want["motion"], {})
        row[str(got["motion"])] = row.get(str(got["motion"]), 0) + 1
    if n == 0:
        return {"colour_acc": 0.0, "shape_acc": 0.0, "motion_acc": 0.0, "all_acc": 0.0, "n": 0,
                "motion_acc_by_motion": {}, "motion_confusion": {}}  # fmt: skip
    return {"colour_acc": c_ok / n, "shape_acc": s_ok / n, "motion_acc": m_ok / n, "all_acc": all_ok / n,
            "n": n, "motion_acc_by_motion": {k: v[0] / v[1] for k, v in sorted(per.items())},
            "motion_confusion": confusion}  # fmt: skip
