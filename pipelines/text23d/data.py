"""Shard samples (`data.synth --3d`, `data.make_shards meshes`) -> tensors.

A sample holds `npy` (P, 6) surface points (xyz + rgb, uniform by area, so any prefix is a uniform
subsample), optionally `occ.npy` (Q, 7) occupancy queries (xyz, inside, rgb; the first half near
the surface, the second half uniform) and a caption. Model space is [-1, 1] for xyz and rgb alike:
the scene box [-0.5, 0.5]^3 and colours [0, 1] are both scaled by 2 and shifted.
"""
from __future__ import annotations

import io

import numpy as np
import torch

from common.data.captions import caption_of


def to_model_space(points: torch.Tensor) -> torch.Tensor:
    """(..., 6) scene xyz + rgb [0, 1] -> [-1, 1] for both (a (..., 3) tensor is treated as xyz)."""
    out = points * 2.0
    if points.shape[-1] > 3:
        out[..., 3:6] -= 1.0
    return out


def from_model_space(x: torch.Tensor) -> torch.Tensor:
    """Inverse of to_model_space; colours clamped to [0, 1]."""
    out = x / 2.0
    if x.shape[-1] > 3:
        out[..., 3:6] = ((x[..., 3:6] + 1.0) / 2.0).clamp(0.0, 1.0)
    return out


def _array(sample: dict, key: str) -> np.ndarray:
    try:
        return np.load(io.BytesIO(sample[key]), allow_pickle=False)
    except Exception as e:
        raise ValueError(f"{key} is not a readable .npy array ({type(e).__name__}: {e})") from None


class ShapeDecoder:
    """Picklable loader decoder: {"points": (points, 6) float32, "occ": (queries, 7) float32 when
    queries > 0, "caption"}. A bad sample raises ValueError naming what is wrong (the loader skips
    and counts it)."""

    def __init__(self, points: int, queries: int = 0):
        self.points, self.queries = points, queries

    def __call__(self, sample: dict) -> dict:
        if "npy" not in sample:
            raise ValueError("sample has no point cloud (npy)")
        pts = _array(sample, "npy")
        if pts.ndim != 2 or pts.shape[1] < 3:
            raise ValueError(f"point cloud has shape {pts.shape}, expected (N, 6): xyz + rgb")
        if pts.shape[1] != 6:
            raise ValueError(f"point cloud has {pts.shape[1]} columns, expected 6: missing colour (xyz + rgb)")
        if len(pts) < self.points:
            raise ValueError(f"point cloud has {len(pts)} points, fewer than the {self.points} the model takes")
        pts = pts[:self.points].astype(np.float32)
        if not np.isfinite(pts).all():
            raise ValueError("point cloud has NaN or infinite values")
        out = {"points": torch.from_numpy(pts), "caption": caption_of(sample)}
        if self.queries:
            out["occ"] = torch.from_numpy(self._queries(sample))
        return out

    def _queries(self, sample: dict) -> np.ndarray:
        if "occ.npy" not in sample:
            raise ValueError("sample has no occupancy queries (occ.npy; write them with make_shards meshes --occupancy)")
        occ = _array(sample, "occ.npy")
        if occ.ndim != 2 or occ.shape[1] != 7:
            raise ValueError(f"occ.npy has shape {occ.shape}, expected (Q, 7): xyz, occupancy, rgb")
        half, want = len(occ) // 2, self.queries // 2
        if half < want:
            raise ValueError(f"occ.npy has {len(occ)} queries, fewer than the {self.queries} per step")
        occ = np.concatenate([occ[:want], occ[half:half + want]]).astype(np.float32)  # near, then uniform
        if not np.isfinite(occ).all():
            raise ValueError("occ.npy has NaN or infinite values")
        return occ
