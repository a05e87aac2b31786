"""common.data.pointclouds: PLY round trips, the point splatter, turntable files."""
from __future__ import annotations

import numpy as np
import torch
import trimesh
from PIL import Image

from common.data.pointclouds import BACKGROUND, read_ply, render_views, write_ply, write_turntable


def _cluster(centre, rgb, n=300, sigma=0.02, seed=0) -> np.ndarray:
    xyz = np.random.default_rng(seed).normal(centre, sigma, (n, 3))
    return np.c_[xyz, np.tile(rgb, (n, 1))].astype(np.float32)


def _asymmetric() -> np.ndarray:
    # Three blobs of different colours, sizes and heights: no turn by a multiple of 45 degrees
    # maps it onto itself.
    return np.r_[_cluster((0.2, 0, 0), (1, 0, 0), seed=1),
                 _cluster((0.4, 0, 0.3), (0, 0, 1), seed=2),
                 _cluster((-0.3, 0.3, 0.2), (0, 0.8, 0), sigma=0.08, seed=3)]


def test_ply_round_trip_cloud(tmp_path):
    rng = np.random.default_rng(0)
    xyz = rng.uniform(-0.55, 0.55, (500, 3)).astype(np.float32)
    rgb = rng.uniform(0, 1, (500, 3))
    path = str(tmp_path / "sub" / "cloud.ply")
    write_ply(path, torch.tensor(xyz), rgb)
    xyz2, rgb2, faces2 = read_ply(path)
    assert xyz2.dtype == np.float32 and np.array_equal(xyz2, xyz)
    assert rgb2.dtype == np.float32
    assert np.array_equal(rgb2, (np.round(rgb * 255) / 255).astype(np.float32))
    assert faces2 is None
    write_ply(path, xyz)
    assert read_ply(path)[1] is None


def test_ply_round_trip_coloured_mesh(tmp_path):
    sphere = trimesh.creation.icosphere(subdivisions=2, radius=0.4)
    xyz = np.asarray(sphere.vertices, np.float32)
    faces = np.asarray(sphere.faces, np.int64)
    rgb = np.random.default_rng(1).integers(0, 256, (len(xyz), 3)) / 255.0
    path = str(tmp_path / "mesh.ply")
    write_ply(path, xyz, rgb, faces)
    xyz2, rgb2, faces2 = read_ply(path)
    assert np.array_equal(xyz2, xyz)
    assert np.array_equal(rgb2, rgb.astype(np.float32))
    assert faces2.dtype == np.int64 and np.array_equal(faces2, faces)
    write_ply(path, xyz, faces=faces)
    _, rgb3, faces3 = read_ply(path)
    assert rgb3 is None and np.array_equal(faces3, faces)


def test_red_cluster_at_centre():
    size = 64
    img = render_views(_cluster((0, 0, 0), (1, 0, 0)), views=4, size=size).numpy()
    assert img.shape == (4, size, size, 3) and img.dtype == np.uint8
    c = size // 2
    for v in range(4):
        r, g, b = img[v, c, c].astype(int)
        assert r > 150 and g < 40 and b < 40, (v, r, g, b)
        assert (img[v, 0, 0] == BACKGROUND).all() and (img[v, -1, -1] == BACKGROUND).all()


def test_position_is_kept():
    # A cluster high up the box must render above the image centre: no re-normalisation.
    img = render_views(_cluster((0, 0, 0.4), (1, 0, 0)), views=3, size=64).numpy()
    for v in range(3):
        rows = np.nonzero((img[v] != BACKGROUND).any(-1))[0]
        assert rows.mean() < 20


def test_nearest_point_wins():
    # Two sheets facing the camera: red at y = -0.2 (near the view-0 camera on the -y side), blue
    # at y = +0.2. Half a turn later the blue one is in front.
    g = np.linspace(-0.2, 0.2, 60)
    x, z = [a.ravel() for a in np.meshgrid(g, g)]
    red = np.c_[x, np.full_like(x, -0.2), z, np.tile([1, 0, 0], (len(x), 1))]
    blue = np.c_[x, np.full_like(x, 0.2), z, np.tile([0, 0, 1], (len(x), 1))]
    for cloud in (np.r_[red, blue], np.r_[blue, red]):  # order of points must not matter
        img = render_views(cloud, views=2, size=64, elevation_deg=0).numpy()
        assert img[0, 32, 32, 0] > 100 and img[0, 32, 32, 2] == 0
        assert img[1, 32, 32, 2] > 100 and img[1, 32, 32, 0] == 0


def test_asymmetric_cloud_gives_distinct_views():
    img = render_views(torch.tensor(_asymmetric()), views=8, size=48).numpy()
    for i in range(8):
        for j in range(i + 1, 8):
            assert not np.array_equal(img[i], img[j]), (i, j)


def test_empty_cloud_is_background():
    img = render_views(np.zeros((0, 6)), views=2, size=16)
    assert img.shape == (2, 16, 16, 3) and (img == BACKGROUND).all()


def test_write_turntable(tmp_path):
    clouds = [_asymmetric(), _cluster((0.2, 0.1, 0), (0, 0, 1)), _asymmetric()[::2]]
    size, views = 32, 5
    png, gif = write_turntable(clouds, str(tmp_path / "out" / "turn"), views=views, size=size)
    assert png.endswith("turn.png") and gif.endswith("turn.gif")
    tile = size + 2  # tiles sit on a 2-px white grid (common.data.images.tile)
    with Image.open(png) as im:
        assert im.size == (views * tile + 2, len(clouds) * tile + 2)
    with Image.open(gif) as im:
        assert im.n_frames == views
        assert im.size == (2 * tile + 2, 2 * tile + 2)  # 3 clouds in a 2 x 2 grid
