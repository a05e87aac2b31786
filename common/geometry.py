"""3-D geometry shared by the text-to-3D pipeline: point-cloud distances and metrics, farthest
point sampling, occupancy grids and marching cubes.

Scenes live in the box BOUNDS^3 = [-0.55, 0.55]^3 with z up. Functions taking clouds accept torch
tensors or numpy arrays; metrics return Python floats, batched variants return tensors.
"""
from __future__ import annotations

import numpy as np
import torch

BOUNDS = (-0.55, 0.55)

# Elements of one (chunk, M) distance block: 4M floats = 16 MiB, so 8k x 8k needs ~20 MiB of
# scratch instead of 256 MiB for the full matrix.
_BLOCK_ELEMS = 1 << 22


def _as_tensor(x) -> torch.Tensor:
    t = torch.as_tensor(x)
    return t if t.is_floating_point() else t.float()


def _pair(a, b) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = _as_tensor(a), _as_tensor(b)
    dtype = torch.promote_types(a.dtype, b.dtype)
    if a.shape[-1] != 3 or b.shape[-1] != 3 or a.dim() != b.dim() or a.dim() not in (2, 3):
        raise ValueError(f"expected (N, 3) / (M, 3) or (B, N, 3) / (B, M, 3) clouds, got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[-2] == 0 or b.shape[-2] == 0:
        raise ValueError(f"empty cloud: {tuple(a.shape)} and {tuple(b.shape)}")
    return a.to(dtype), b.to(device=a.device, dtype=dtype)


def nearest_distances(a, b) -> torch.Tensor:
    """For each point of a, the L2 (not squared) distance to its nearest point of b.

    a (N, 3), b (M, 3) -> (N,); or batched a (B, N, 3), b (B, M, 3) -> (B, N). Differentiable.
    Computed in row chunks of a so memory stays ~16 MiB whatever N and M are.
    """
    a, b = _pair(a, b)
    single = a.dim() == 2
    if single:
        a, b = a[None], b[None]
    rows = max(1, _BLOCK_ELEMS // (a.shape[0] * b.shape[1]))
    # The matmul form of cdist (|a|^2 + |b|^2 - 2ab) cancels catastrophically for close points
    # (~1e-4 error on distances of ~1e-3); the direct difference form is exact to rounding.
    out = torch.cat([torch.cdist(a[:, i:i + rows], b, compute_mode="donot_use_mm_for_euclid_dist")
                     .amin(dim=-1) for i in range(0, a.shape[1], rows)], dim=1)
    return out[0] if single else out


def chamfer_distance_batch(a, b) -> torch.Tensor:
    """(B, N, 3), (B, M, 3) -> (B,) symmetric Chamfer distance, see chamfer_distance."""
    return nearest_distances(a, b).mean(-1) + nearest_distances(b, a).mean(-1)


def chamfer_distance(a, b) -> float:
    """Symmetric Chamfer distance of clouds a (N, 3) and b (M, 3): the mean over a of the L2
    (not squared) distance to the nearest point of b, plus the same from b to a."""
    return float(chamfer_distance_batch(*(_as_tensor(x)[None] for x in (a, b)))[0])


def f_score_batch(a, b, threshold: float = 0.05) -> torch.Tensor:
    """(B, N, 3), (B, M, 3) -> (B,) F-score at `threshold`, see f_score."""
    precision = (nearest_distances(a, b) < threshold).double().mean(-1)
    recall = (nearest_distances(b, a) < threshold).double().mean(-1)
    total = precision + recall
    return torch.where(total > 0, 2 * precision * recall / total.clamp_min(1e-300), 0.0)


def f_score(a, b, threshold: float = 0.05) -> float:
    """F-score of a (N, 3) against b (M, 3): harmonic mean of precision (fraction of a strictly
    closer than `threshold` to b, L2) and recall (fraction of b closer than it to a); 0 when
    both are 0."""
    return float(f_score_batch(*(_as_tensor(x)[None] for x in (a, b)), threshold=threshold)[0])


@torch.no_grad()
def farthest_point_sample(points, k: int) -> torch.Tensor:
    """Iterative farthest point sampling: (B, N, 3) -> (B, k) long indices ((N, 3) -> (k,)).

    Deterministic: starts at index 0 and breaks ties by the lowest index. Returns indices only,
    so it runs without autograd whether the caller is training or not; gather with them.
    """
    p = _as_tensor(points).detach()
    single = p.dim() == 2
    if single:
        p = p[None]
    if p.dim() != 3 or p.shape[-1] != 3:
        raise ValueError(f"expected (B, N, 3) points, got {tuple(p.shape)}")
    bsz, n, _ = p.shape
    if not 0 <= k <= n:
        raise ValueError(f"cannot sample {k} of {n} points")
    idx = torch.zeros(bsz, k, dtype=torch.long, device=p.device)
    # Squared distance of every point to the chosen set so far; argmax is the next pick.
    dist = torch.full((bsz, n), float("inf"), dtype=p.dtype, device=p.device)
    rows = torch.arange(bsz, device=p.device)
    last = torch.zeros(bsz, dtype=torch.long, device=p.device)
    for i in range(k):
        idx[:, i] = last
        d = (p - p[rows, last][:, None]).square().sum(-1)
        dist = torch.minimum(dist, d)
        last = dist.argmax(dim=-1)  # torch returns the first maximal index: deterministic ties
    return idx[0] if single else idx


def grid_points(resolution: int, bounds: tuple[float, float] = BOUNDS) -> np.ndarray:
    """(R^3, 3) float32 cell-corner coordinates of an R^3 grid spanning bounds on every axis, in
    C order over (x, y, z) indices: values.reshape(R, R, R) is the field marching_cubes takes."""
    lin = np.linspace(bounds[0], bounds[1], resolution, dtype=np.float64)
    return np.stack(np.meshgrid(lin, lin, lin, indexing="ij"), axis=-1).reshape(-1, 3).astype(np.float32)


def marching_cubes(field, level: float = 0.0, bounds: tuple[float, float] = BOUNDS,
                   inside_positive: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Closed surface of a field sampled on grid_points(R, bounds): (vertices (V, 3) float32 in
    the bounds frame, faces (F, 3) int64), outward oriented.

    Inside is field > level (field < level when inside_positive=False). The grid is padded with
    an outside value, so a shape cut by the grid border is capped there and the mesh stays
    watertight; a field that is inside everywhere therefore gives the box itself. Empty arrays
    when nothing is inside.
    """
    from skimage import measure  # heavy import, only needed here

    f = field.detach().cpu().numpy() if isinstance(field, torch.Tensor) else np.asarray(field)
    if f.ndim != 3 or min(f.shape) < 2:
        raise ValueError(f"expected a 3-D field of at least 2 samples per axis, got {f.shape}")
    if not np.isfinite(f).all():
        raise ValueError("field has NaN or inf values")
    f = f.astype(np.float64)
    if not inside_positive:
        f, level = -f, -level
    empty = np.zeros((0, 3), np.float32), np.zeros((0, 3), np.int64)
    if not (f > level).any():
        return empty
    outside = min(float(f.min()), level) - 1.0
    padded = np.pad(f, 1, mode="constant", constant_values=outside)
    lo, hi = bounds
    spacing = tuple((hi - lo) / (s - 1) for s in f.shape)
    # skimage's default winding ("descent") points normals into the larger values, i.e. inward
    # here; "ascent" gives outward faces and so a positive signed volume.
    verts, faces, _, _ = measure.marching_cubes(padded, level=level, spacing=spacing,
                                                gradient_direction="ascent")
    # Padding shifts indices by one cell; the cap lies between the border and the pad cell, so
    # clamp it back onto the border (the mesh's topology is unchanged).
    verts = np.clip(verts - np.asarray(spacing) + lo, lo, hi)
    return verts.astype(np.float32), faces.astype(np.int64)


def occupancy_iou(pred, target) -> float:
    """Intersection over union of two boolean occupancy arrays (numpy or torch) of one shape;
    1.0 when both are empty (they agree exactly)."""
    p = pred.detach().cpu().numpy() if isinstance(pred, torch.Tensor) else np.asarray(pred)
    t = target.detach().cpu().numpy() if isinstance(target, torch.Tensor) else np.asarray(target)
    if p.shape != t.shape:
        raise ValueError(f"shape mismatch: {p.shape} vs {t.shape}")
    p, t = p.astype(bool), t.astype(bool)
    union = np.logical_or(p, t).sum()
    return 1.0 if union == 0 else float(np.logical_and(p, t).sum() / union)
