"""Meshes for `make_shards meshes`, loaded and sampled with trimesh.

Sample format (one sample per mesh file):

    __key__  "{input index:09d}"
    npy      float16 array (N, 6): xyz then rgb. xyz is normalised to the unit cube: centred on
             the bounding-box centre and divided by the longest side, so it lies in [-0.5, 0.5]^3.
             rgb in [0, 1]: the texture / vertex colour (barycentric interpolation) / face colour
             at each point when the mesh has one, else --default-color.
    txt      caption (same-stem .txt sidecar, or the manifest's caption/text column)
    json     {"vertices", "faces", "bounds" (original [[min xyz], [max xyz]]), "center", "scale"
              (original = normalised * scale + center), "points", "color" (texture/vertex/face/
              default, "/"-joined over parts), "parts" (scene geometries), "source"}

Points are sampled uniformly by area with a seed derived from the input index (reproducible).
Rendered views are not produced.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass

import numpy as np

from data.sources.common import Item

MESH_EXTS = (".obj", ".ply", ".glb", ".gltf", ".stl", ".off")


@dataclass(frozen=True)
class MeshOpts:
    points: int = 4096
    default_color: tuple = (0.7, 0.7, 0.7)


def _colors(mesh, faces: np.ndarray, bary: np.ndarray, sampled, opts: MeshOpts):
    vis = mesh.visual
    kind = getattr(vis, "kind", None)
    if sampled is not None:  # texture colours from trimesh's own sampler
        return np.asarray(sampled, dtype=np.float64)[:, :3] / 255.0, "texture"
    if kind == "vertex":
        vc = np.asarray(vis.vertex_colors, dtype=np.float64)[:, :3] / 255.0
        tri = vc[mesh.faces[faces]]  # (N, 3 corners, rgb)
        return np.einsum("nc,ncr->nr", bary, tri), "vertex"
    if kind == "face":
        return np.asarray(vis.face_colors, dtype=np.float64)[faces, :3] / 255.0, "face"
    return np.tile(np.asarray(opts.default_color, dtype=np.float64), (len(faces), 1)), "default"


def _parts(obj) -> list:
    """Triangle meshes of a load result, scene transforms applied (no Scene.dump: it needs scipy
    for face-coloured meshes)."""
    import trimesh

    if isinstance(obj, trimesh.Trimesh):
        return [obj] if len(obj.faces) and obj.area > 0 else []
    parts = []
    if isinstance(obj, trimesh.Scene):
        for node in obj.graph.nodes_geometry:
            transform, name = obj.graph[node]
            g = obj.geometry.get(name)
            if isinstance(g, trimesh.Trimesh) and len(g.faces) and g.area > 0:
                v = trimesh.transformations.transform_points(g.vertices, transform)
                parts.append(trimesh.Trimesh(vertices=v, faces=g.faces, visual=g.visual, process=False))
    return parts


def process_mesh(item: Item, opts: MeshOpts) -> tuple[Item, dict | None]:
    if item.error:
        return item, None
    import trimesh

    if not os.path.isfile(item.source):
        item.error = "missing file"
        return item, None
    try:
        parts = _parts(trimesh.load(item.source, process=False))
        if not parts:
            raise ValueError("no faces")
    except Exception as e:  # loaders raise many types for bad data; all mean "unreadable"
        item.error = f"unreadable mesh: {type(e).__name__}: {e}"
        return item, None
    try:
        rng = np.random.default_rng(item.index)
        areas = np.array([m.area for m in parts])
        counts = rng.multinomial(opts.points, areas / areas.sum())
        chunks, kinds = [], set()
        for m, n in zip(parts, counts):
            if n == 0:
                continue
            seed = int(rng.integers(2**31))
            if getattr(m.visual, "kind", None) == "texture":
                pts, faces, sampled = trimesh.sample.sample_surface(m, n, sample_color=True, seed=seed)
                bary = None
            else:
                pts, faces = trimesh.sample.sample_surface(m, n, seed=seed)
                sampled = None
                bary = trimesh.triangles.points_to_barycentric(m.triangles[faces], pts)
            rgb, kind = _colors(m, faces, bary, sampled, opts)
            kinds.add(kind)
            chunks.append(np.concatenate([pts, np.clip(rgb, 0, 1)], axis=1))
        arr = np.concatenate(chunks)
        lo = np.min([m.bounds[0] for m in parts], axis=0)
        hi = np.max([m.bounds[1] for m in parts], axis=0)
        center = (lo + hi) / 2
        scale = float(max(hi - lo)) or 1.0
        arr[:, :3] = (arr[:, :3] - center) / scale
        arr = arr.astype(np.float16)
    except Exception as e:
        item.error = f"sampling failed: {type(e).__name__}: {e}"
        return item, None
    buf = io.BytesIO()
    np.save(buf, arr)
    meta = {"vertices": sum(len(m.vertices) for m in parts), "faces": sum(len(m.faces) for m in parts),
            "bounds": [lo.tolist(), hi.tolist()], "center": center.tolist(), "scale": scale,
            "points": opts.points, "color": "/".join(sorted(kinds)), "parts": len(parts),
            "source": item.source}  # fmt: skip
    return item, {"__key__": f"{item.index:09d}", "npy": buf.getvalue(), "txt": item.caption,
                  "json": json.dumps(meta, sort_keys=True)}  # fmt: skip


class MeshWork:
    def __init__(self, opts: MeshOpts):
        self.opts = opts

    def __call__(self, item: Item):
        return process_mesh(item, self.opts)
