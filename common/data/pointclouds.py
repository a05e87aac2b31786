"""Coloured point clouds and meshes on disk (PLY) and on screen (turntable renders).

A coloured cloud is a float array (N, 6): xyz then rgb in [0, 1], z up, inside the box
[-0.55, 0.55]^3. Renders keep that box fixed (no per-cloud re-normalisation), so a sample's
position and size stay visible and comparable across clouds.
"""
from __future__ import annotations

import math
import os

import numpy as np
import torch
from PIL import Image

from common.data.images import tile

BOX = 0.55
BACKGROUND = 235  # light grey: white and black points both stay visible


def _numpy(x, dtype) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype)


def write_ply(path: str, xyz, rgb=None, faces=None) -> None:
    """Write binary PLY: a point cloud, or a mesh when `faces` (F, 3) is given (an empty faces
    array writes a point cloud). xyz is stored as float32; rgb in [0, 1] is clipped and
    quantised to uint8 as round(255 * rgb), so it reads back as that value / 255."""
    import trimesh

    xyz = _numpy(xyz, np.float32).reshape(-1, 3)
    colours = None
    if rgb is not None:
        rgb = _numpy(rgb, np.float64).reshape(-1, 3)
        if len(rgb) != len(xyz):
            raise ValueError(f"{len(rgb)} colours for {len(xyz)} points")
        colours = np.round(np.clip(rgb, 0.0, 1.0) * 255).astype(np.uint8)
    if faces is not None and len(faces):
        # process=False: vertices must not be merged or reordered, or indices would drift.
        geom = trimesh.Trimesh(xyz, _numpy(faces, np.int64).reshape(-1, 3), vertex_colors=colours,
                               process=False)
    else:
        geom = trimesh.PointCloud(xyz, colors=colours)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(geom.export(file_type="ply", encoding="binary"))


def read_ply(path: str) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(xyz float32 (N, 3), rgb float32 (N, 3) in [0, 1] or None, faces int64 (F, 3) or None)."""
    import trimesh

    geom = trimesh.load(path, file_type="ply", process=False)
    xyz = np.asarray(geom.vertices, dtype=np.float32)
    if isinstance(geom, trimesh.Trimesh):
        faces = np.asarray(geom.faces, dtype=np.int64)
        colours = geom.visual.vertex_colors if geom.visual.kind == "vertex" else None
    else:
        faces = None
        colours = geom.colors if len(geom.colors) else None
    rgb = None if colours is None else np.asarray(colours)[:, :3].astype(np.float32) / 255.0
    return xyz, rgb, faces


def _screen_half_extent(elevation: float) -> float:
    # The box's widest screen footprint over all turntable angles: horizontally its xy diagonal,
    # vertically the diagonal tilted by the elevation plus the tilted height.
    return BOX * max(math.sqrt(2), math.sqrt(2) * abs(math.sin(elevation)) + abs(math.cos(elevation)))


def render_views(cloud, views: int = 8, size: int = 128, elevation_deg: float = 25.0,
                 point_px: float | None = None) -> torch.Tensor:
    """Turntable renders of a coloured cloud (N, 6): uint8 tensor (views, size, size, 3).

    View v turns the cloud by 360 * v / views degrees about z and looks at it from
    `elevation_deg` above the horizon with an orthographic camera framing the whole fixed box.
    Each point is splatted as a flat disc of radius `point_px` pixels (default ~1.5 px at 128,
    scaled with size); the nearest point wins each pixel, and colours are darkened with depth so
    overlapping parts read as 3-D. Points outside the image are dropped.
    """
    c = torch.as_tensor(cloud).detach().cpu().float().reshape(-1, 6)
    xyz, rgb = c[:, :3], c[:, 3:].clamp(0.0, 1.0)
    image = torch.full((views * size * size, 3), float(BACKGROUND))
    if len(c) == 0 or views == 0:
        return image.to(torch.uint8).reshape(views, size, size, 3)

    elev = math.radians(elevation_deg)
    theta = torch.arange(views, dtype=torch.float32) * (2 * math.pi / views)
    cos_t, sin_t = theta.cos()[:, None], theta.sin()[:, None]
    x, y, z = xyz.unbind(-1)
    xr = x * cos_t - y * sin_t  # (V, N)
    yr = x * sin_t + y * cos_t
    # Camera on the -y side, raised by the elevation: screen right is x, screen up and the
    # depth (towards the camera, larger = nearer) mix y and z.
    u = xr
    w = yr * math.sin(elev) + z * math.cos(elev)
    depth = -yr * math.cos(elev) + z * math.sin(elev)

    half = _screen_half_extent(elev)
    radius = 1.5 * size / 128 if point_px is None else float(point_px)
    scale = (size - 1 - 2 * radius) / (2 * half)  # keep splats of box corners inside the image
    col = ((u + half) * scale + radius).round().long()
    row = ((half - w) * scale + radius).round().long()

    r = math.floor(radius)
    offs = [(dy, dx) for dy in range(-r, r + 1) for dx in range(-r, r + 1) if dy * dy + dx * dx <= radius * radius]
    offs = torch.tensor(offs, dtype=torch.long)  # (K, 2); (0, 0) is always there
    rows = row[..., None] + offs[:, 0]  # (V, N, K)
    cols = col[..., None] + offs[:, 1]
    view_idx = torch.arange(views)[:, None, None].expand_as(rows)
    point_idx = torch.arange(len(c))[None, :, None].expand_as(rows)
    keep = (rows >= 0) & (rows < size) & (cols >= 0) & (cols < size)
    pix = ((view_idx * size + rows) * size + cols)[keep]
    d = depth[..., None].expand_as(rows)[keep]
    pts = point_idx[keep]

    zbuf = torch.full((views * size * size,), -math.inf).scatter_reduce(0, pix, d, "amax")
    # Among fragments at the winning depth, the highest point index wins: deterministic ties.
    winner = torch.where(d == zbuf[pix], pts, -1)
    best = torch.full_like(zbuf, -1, dtype=torch.long).scatter_reduce(0, pix, winner, "amax")
    hit = best >= 0

    depth_range = BOX * math.sqrt(3)  # the box's half-diagonal bounds |depth| in every view
    shade = 0.5 + 0.5 * (zbuf[hit] + depth_range) / (2 * depth_range)
    image[hit] = rgb[best[hit]] * shade[:, None] * 255.0
    return image.round().clamp(0, 255).to(torch.uint8).reshape(views, size, size, 3)


def write_turntable(clouds: list, stem: str, views: int = 8, size: int = 96,
                    duration_ms: int = 150) -> list[str]:
    """Render each cloud from `views` angles and write [stem.png, stem.gif]: the PNG has one
    row per cloud and one column per view; GIF frame k tiles view k of every cloud in a
    near-square grid. Pillow merges consecutive identical frames (summing their durations), so a
    rotation-symmetric cloud can give fewer frames with the same playback."""
    renders = torch.stack([render_views(c, views=views, size=size) for c in clouds])  # (C, V, S, S, 3)
    png, gif = stem + ".png", stem + ".gif"
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    Image.fromarray(tile(renders.reshape(-1, 1, size, size, 3), cols=views)[0]).save(png)
    frames = [Image.fromarray(f) for f in tile(renders)]
    frames[0].save(gif, save_all=True, append_images=frames[1:], duration=duration_ms, loop=0)
    return [png, gif]
