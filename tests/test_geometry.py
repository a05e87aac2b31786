"""common.geometry: Chamfer / F-score against brute force, FPS, marching cubes, IoU."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import trimesh

import common.geometry as geometry
from common.geometry import (chamfer_distance, chamfer_distance_batch, f_score, f_score_batch,
                             farthest_point_sample, grid_points, marching_cubes, nearest_distances,
                             occupancy_iou)


def _brute_chamfer(a: np.ndarray, b: np.ndarray) -> float:
    d = np.sqrt(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1))
    return d.min(1).mean() + d.min(0).mean()


def _sphere_field(resolution: int, radius: float, centre=(0.0, 0.0, 0.0)) -> np.ndarray:
    g = grid_points(resolution)
    return (radius - np.linalg.norm(g - np.asarray(centre), axis=1)).reshape((resolution,) * 3)


# ---- Chamfer / F-score --------------------------------------------------------------------------

def test_chamfer_identical_is_zero():
    a = np.random.default_rng(0).uniform(-0.5, 0.5, (500, 3))
    assert chamfer_distance(a, a) == 0.0
    assert chamfer_distance(torch.as_tensor(a, dtype=torch.float32), a.astype(np.float32)) == 0.0


def test_chamfer_matches_brute_force(monkeypatch):
    rng = np.random.default_rng(1)
    a, b = rng.uniform(-0.5, 0.5, (300, 3)), rng.uniform(-0.5, 0.5, (170, 3))
    ref = _brute_chamfer(a, b)
    assert chamfer_distance(a, b) == pytest.approx(ref, abs=1e-5)
    assert chamfer_distance(torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)) \
        == pytest.approx(ref, abs=1e-5)
    # Force many small chunks: the chunked path must give the same numbers.
    monkeypatch.setattr(geometry, "_BLOCK_ELEMS", 1000)
    assert chamfer_distance(a, b) == pytest.approx(ref, abs=1e-5)


def test_chamfer_batch_matches_single():
    rng = np.random.default_rng(2)
    a, b = rng.uniform(-0.5, 0.5, (3, 120, 3)), rng.uniform(-0.5, 0.5, (3, 90, 3))
    batch = chamfer_distance_batch(a, b)
    assert batch.shape == (3,)
    for i in range(3):
        assert batch[i].item() == pytest.approx(_brute_chamfer(a[i], b[i]), abs=1e-5)
    assert nearest_distances(a, b).shape == (3, 120)


def test_chamfer_shifted_grid():
    # Grid spacing 0.1 and a shift of 0.03 < spacing / 2: every point's nearest neighbour is its
    # own shifted copy, so each direction contributes exactly 0.03.
    lin = np.arange(-0.4, 0.41, 0.1)
    a = np.stack(np.meshgrid(lin, lin, lin, indexing="ij"), -1).reshape(-1, 3)
    b = a + np.array([0.03, 0.0, 0.0])
    assert chamfer_distance(a, b) == pytest.approx(0.06, abs=1e-6)


def test_f_score_cases():
    a = np.random.default_rng(3).uniform(-0.5, 0.5, (200, 3))
    assert f_score(a, a) == 1.0
    assert f_score(a, a + 10.0) == 0.0
    a = np.array([[0, 0, 0], [1, 0, 0], [2, 0, 0], [3, 0, 0]], dtype=np.float64)
    b = np.array([[0, 0, 0.01], [1, 0, 0.01], [10, 0, 0]], dtype=np.float64)
    # precision 2/4, recall 2/3 -> F = 2 * (1/2) * (2/3) / (1/2 + 2/3) = 4/7
    assert f_score(a, b, threshold=0.05) == pytest.approx(4 / 7)
    assert f_score(a, b, threshold=0.005) == 0.0
    # Second pair: precision 3/4, recall 1 -> 6/7.
    batch = f_score_batch(np.stack([a, a]), np.stack([b, a[:3]]))
    assert batch.tolist() == pytest.approx([4 / 7, 6 / 7])


def test_bad_shapes_raise():
    with pytest.raises(ValueError):
        chamfer_distance(np.zeros((4, 2)), np.zeros((4, 3)))
    with pytest.raises(ValueError):
        chamfer_distance(np.zeros((0, 3)), np.zeros((4, 3)))


# ---- farthest point sampling --------------------------------------------------------------------

def _brute_fps(points: np.ndarray, k: int) -> list[int]:
    chosen = [0]
    while len(chosen) < k:
        # Recompute the distance to the whole chosen set each step (no running minimum).
        d = np.sqrt(((points[:, None, :] - points[None, chosen, :]) ** 2).sum(-1)).min(1)
        chosen.append(int(np.argmax(d)))
    return chosen


def test_fps_line_picks_ends_first():
    n = 101
    x = np.linspace(-0.5, 0.5, n)
    order = np.r_[0, 1 + np.random.default_rng(4).permutation(n - 1)]  # index 0 stays at x = -0.5
    pts = torch.tensor(np.stack([x, np.zeros(n), np.zeros(n)], -1)[order])[None]
    idx = farthest_point_sample(pts, 3)[0]
    assert idx.dtype == torch.long
    assert pts[0, idx[0], 0].item() == -0.5
    assert pts[0, idx[1], 0].item() == 0.5
    assert pts[0, idx[2], 0].item() == pytest.approx(0.0)


def test_fps_matches_brute_force():
    rng = np.random.default_rng(5)
    pts = rng.uniform(-0.5, 0.5, (3, 200, 3))
    idx = farthest_point_sample(torch.tensor(pts), 24)
    assert idx.shape == (3, 24)
    for b in range(3):
        assert idx[b].tolist() == _brute_fps(pts[b], 24)
        assert len(set(idx[b].tolist())) == 24


def test_fps_under_autograd_and_unbatched():
    pts = torch.rand(2, 64, 3, requires_grad=True)
    idx = farthest_point_sample(pts, 8)
    assert not idx.requires_grad
    picked = torch.gather(pts, 1, idx[..., None].expand(-1, -1, 3))
    picked.sum().backward()  # gathering by the indices keeps the graph for the caller
    assert pts.grad is not None and pts.grad.sum().item() == pytest.approx(2 * 8 * 3)
    assert torch.equal(farthest_point_sample(pts[0].detach().numpy(), 8), idx[0])
    with pytest.raises(ValueError):
        farthest_point_sample(pts, 65)


# ---- grids, marching cubes, IoU -----------------------------------------------------------------

def test_grid_points_order():
    r = 5
    g = grid_points(r).reshape(r, r, r, 3)
    lin = np.linspace(-0.55, 0.55, r)
    assert g.dtype == np.float32
    assert np.allclose(g[1, 2, 3], [lin[1], lin[2], lin[3]])
    assert np.allclose(g[0, 0, 0], [-0.55] * 3) and np.allclose(g[-1, -1, -1], [0.55] * 3)


def test_marching_cubes_sphere_watertight_and_volume():
    r = 0.4
    verts, faces = marching_cubes(_sphere_field(48, r))
    assert verts.dtype == np.float32 and faces.dtype == np.int64
    mesh = trimesh.Trimesh(verts, faces, process=False)
    assert mesh.is_watertight
    assert mesh.volume == pytest.approx(4 / 3 * math.pi * r ** 3, rel=0.05)  # positive: outward faces
    # The other sign convention gives the same surface.
    v2, f2 = marching_cubes(torch.tensor(-_sphere_field(48, r)), inside_positive=False)
    assert trimesh.Trimesh(v2, f2, process=False).volume == pytest.approx(mesh.volume)


def test_marching_cubes_frame_matches_grid_points():
    centre = np.array([0.2, -0.1, 0.05])
    verts, _ = marching_cubes(_sphere_field(32, 0.2, centre))
    assert np.abs(verts.mean(0) - centre).max() < 0.01
    assert np.abs(np.linalg.norm(verts - centre, axis=1) - 0.2).max() < 0.01


def test_marching_cubes_touching_border_is_closed():
    for radius, centre in [(0.7, (0, 0, 0)), (0.3, (0.45, 0.45, 0.0))]:
        verts, faces = marching_cubes(_sphere_field(24, radius, centre))
        mesh = trimesh.Trimesh(verts, faces, process=False)
        assert mesh.is_watertight and mesh.volume > 0
        assert verts.min() >= -0.55 and verts.max() <= 0.55


def test_marching_cubes_empty_field():
    for field in (np.full((8, 8, 8), -1.0), np.zeros((8, 8, 8))):
        verts, faces = marching_cubes(field)
        assert verts.shape == (0, 3) and verts.dtype == np.float32
        assert faces.shape == (0, 3) and faces.dtype == np.int64


def test_occupancy_iou():
    a = np.zeros((4, 4, 4), bool)
    b = np.zeros((4, 4, 4), bool)
    a[:2] = True   # 32 cells
    b[1:3] = True  # 32 cells, 16 shared
    assert occupancy_iou(a, b) == pytest.approx(16 / 48)
    assert occupancy_iou(torch.tensor(a), torch.tensor(a)) == 1.0
    assert occupancy_iou(a, ~a) == 0.0
    assert occupancy_iou(np.zeros(3, bool), np.zeros(3, bool)) == 1.0
