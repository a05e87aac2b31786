"""Meshes for `make_shards meshes`, loaded and sampled with trimesh.

Sample format (one sample per mesh file):

    __key__  "{input index:09d}"
    npy      float16 array (N, 6): xyz then rgb. xyz is normalised to the unit cube: centred on
             the bounding-box centre and divided by the longest side, so it lies in [-0.5, 0.5]^3.
             rgb in [0, 1]: the texture / vertex colour (barycentric interpolation) / face colour
             at each point when the mesh has one, else --default-color.
    occ.npy  float16 array (Q, 7): xyz (same normalised frame), occupancy in {0, 1}, rgb; absent
             with --occupancy 0. Rows [0, Q/2) are surface points plus gaussian noise (half sigma
             0.01, half 0.04), rows [Q/2, Q) uniform in [-0.55, 0.55]^3. Occupancy: generalized
             |winding number| of the triangle soup > 0.5 (either orientation) (see `winding_number`), at the stored
             float16 xyz; rgb: that of the nearest point of the npy cloud.
    txt      caption (same-stem .txt sidecar, or the manifest's caption/text column)
    json     {"vertices", "faces", "bounds" (original [[min xyz], [max xyz]]), "center", "scale"
              (original = normalised * scale + center), "points", "occupancy" (Q), "color"
              (texture/vertex/face/default, "/"-joined over parts), "parts" (scene geometries),
              "source"}

Points are sampled uniformly by area with a seed derived from the input index (reproducible); the
occupancy queries draw from a second seed of it, so the cloud does not depend on Q.

Skipped, each with its own reason in the report: missing file, unreadable mesh, no faces,
non-finite vertices (NaN / inf), zero-area mesh, and, only when occupancy is asked for, a
non-manifold mesh (an edge shared by more than 2 faces: inside / outside is undefined). Open
meshes are kept: the winding number degrades gracefully over small holes. Its cost is
O(Q x faces): ~0.1 s per 1000 faces at Q = 2048.
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
    occupancy: int = 2048  # occ.npy queries per mesh; 0: none


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


def winding_number(triangles: np.ndarray, points: np.ndarray, chunk_elems: int = 1 << 15) -> np.ndarray:
    """Generalized winding number (M,) of a triangle soup (F, 3, 3) at points (M, 3).

    The sum of the signed solid angles of the triangles seen from each point, over 4 pi: 1 inside
    and 0 outside a closed, consistently oriented (outward) surface, and still a graded inside
    measure for soups with small holes, overlapping parts or self-intersections, which is why
    occupancy uses it rather than ray parity.
    Solid angle by Van Oosterom & Strackee: tan(omega / 2) = a.(b x c) / (|a||b||c| + (a.b)|c| +
    (b.c)|a| + (c.a)|b|), a, b, c the corners relative to the point. Chunked over points, about
    `chunk_elems` (point, triangle) pairs at a time (small chunks stay in cache: faster).
    """
    tri = np.asarray(triangles, dtype=np.float64).reshape(-1, 3, 3)
    pts = np.asarray(points, dtype=np.float64).reshape(-1, 3)
    out = np.zeros(len(pts), dtype=np.float64)
    if len(tri) == 0:
        return out
    corners = [[tri[None, :, k, i] for i in range(3)] for k in range(3)]  # [corner][axis] (1, F)
    step = max(1, chunk_elems // len(tri))
    for s in range(0, len(pts), step):
        p = pts[s : s + step, :, None]  # (m, 3, 1)
        (ax, ay, az), (bx, by, bz), (cx, cy, cz) = ([c[i] - p[:, i] for i in range(3)] for c in corners)
        la, lb, lc = (np.sqrt(x * x + y * y + z * z) for x, y, z in ((ax, ay, az), (bx, by, bz), (cx, cy, cz)))
        num = ax * (by * cz - bz * cy) + ay * (bz * cx - bx * cz) + az * (bx * cy - by * cx)
        den = (la * lb * lc + (ax * bx + ay * by + az * bz) * lc + (bx * cx + by * cy + bz * cz) * la
               + (cx * ax + cy * ay + cz * az) * lb)  # fmt: skip
        out[s : s + step] = np.arctan2(num, den).sum(axis=1)  # omega / 2 per triangle
    return out / (2 * np.pi)


OCC_SIGMAS = (0.01, 0.04)  # near-surface noise: half the near queries at each
OCC_BOX = 0.55  # uniform queries fill [-OCC_BOX, OCC_BOX]^3, a margin around the unit cube


def occupancy_queries(surface: np.ndarray, count: int, rng: np.random.Generator, inside) -> np.ndarray:
    """The occ.npy array: float16 (count, 7) xyz, occupancy in {0, 1}, rgb.

    surface: (P, 6) float xyz + rgb of the sampled surface cloud; inside(xyz (M, 3) float64) ->
    bool (M,). The first count // 2 rows are surface points plus gaussian noise (half of them sigma
    OCC_SIGMAS[0], half OCC_SIGMAS[1]): the labels that matter are near the surface. The rest are
    uniform in [-OCC_BOX, OCC_BOX]^3. Labels are computed at the float16-rounded xyz that is
    stored, so a stored row never contradicts its own label. rgb is that of the nearest surface
    point.
    """
    surface = np.asarray(surface, dtype=np.float64)
    n_near = count // 2
    n_fine = n_near // 2
    idx = rng.choice(len(surface), size=n_near, replace=n_near > len(surface))
    sigma = np.where(np.arange(n_near) < n_fine, OCC_SIGMAS[0], OCC_SIGMAS[1])[:, None]
    near = surface[idx, :3] + rng.normal(size=(n_near, 3)) * sigma
    far = rng.uniform(-OCC_BOX, OCC_BOX, size=(count - n_near, 3))
    xyz = np.concatenate([near, far]).astype(np.float16).astype(np.float64)
    occ = np.asarray(inside(xyz), dtype=np.float64)
    rgb = surface[:, 3:6]
    if (rgb == rgb[:1]).all():  # one colour (the synthetic primitives): every neighbour has it
        q_rgb = np.broadcast_to(rgb[:1], (count, 3))
    else:
        from scipy.spatial import cKDTree

        q_rgb = rgb[cKDTree(surface[:, :3]).query(xyz)[1]]
    return np.column_stack([xyz, occ, q_rgb]).astype(np.float16)


def _parts(obj) -> list:
    """Triangle meshes of a load result with faces, scene transforms applied (no Scene.dump: it
    needs scipy for face-coloured meshes)."""
    import trimesh

    if isinstance(obj, trimesh.Trimesh):
        return [obj] if len(obj.faces) else []
    parts = []
    if isinstance(obj, trimesh.Scene):
        for node in obj.graph.nodes_geometry:
            transform, name = obj.graph[node]
            g = obj.geometry.get(name)
            if isinstance(g, trimesh.Trimesh) and len(g.faces):
                v = trimesh.transformations.transform_points(g.vertices, transform)
                parts.append(trimesh.Trimesh(vertices=v, faces=g.faces, visual=g.visual, process=False))
    return parts


def max_edge_use(mesh) -> int:
    """Most faces sharing one edge (2 in a closed manifold), vertices merged by position first:
    STL and some exporters give every face its own vertex copies."""
    _, inv = np.unique(np.asarray(mesh.vertices), axis=0, return_inverse=True)
    f = inv.reshape(-1)[np.asarray(mesh.faces)]
    edges = np.sort(f[:, [0, 1, 1, 2, 2, 0]].reshape(-1, 2), axis=1)
    edges = edges[edges[:, 0] != edges[:, 1]]  # collapsed edges of degenerate faces bound nothing
    if not len(edges):
        return 0
    return int(np.unique(edges, axis=0, return_counts=True)[1].max())


def _check(parts: list, occupancy: bool) -> tuple[list, str | None]:
    """The parts worth sampling, or the reason the mesh is skipped. Each reason is its own so the
    report says what to fix."""
    if not parts:
        return parts, "no faces"
    for m in parts:
        if not np.isfinite(np.asarray(m.vertices)[np.unique(m.faces)]).all():
            return parts, "non-finite vertices (NaN or inf)"
    parts = [m for m in parts if m.area > 0]  # zero-area parts of a scene add nothing
    if not parts:
        return parts, "zero-area mesh (every face degenerate)"
    if occupancy:
        worst = max(max_edge_use(m) for m in parts)
        if worst > 2:
            return parts, f"non-manifold mesh (an edge shared by {worst} faces): occupancy undefined"
    return parts, None


def process_mesh(item: Item, opts: MeshOpts) -> tuple[Item, dict | None]:
    if item.error:
        return item, None
    import trimesh

    if not os.path.isfile(item.source):
        item.error = "missing file"
        return item, None
    try:
        obj = trimesh.load(item.source, process=False)
        if isinstance(obj, trimesh.Scene) and not obj.geometry:
            raise ValueError("no geometry")  # what the loaders make of text that is no mesh at all
        parts = _parts(obj)
    except Exception as e:  # loaders raise many types for bad data; all mean "unreadable"
        item.error = f"unreadable mesh: {type(e).__name__}: {e}"
        return item, None
    parts, reason = _check(parts, opts.occupancy > 0)
    if reason:
        item.error = reason
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
    except Exception as e:
        item.error = f"sampling failed: {type(e).__name__}: {e}"
        return item, None
    occ = None
    if opts.occupancy:
        try:
            tris = (np.concatenate([m.triangles for m in parts]) - center) / scale
            # Its own generator: the point cloud stays the same with or without occupancy.
            occ = occupancy_queries(arr, opts.occupancy, np.random.default_rng([item.index, 1]),
                                    lambda q: np.abs(winding_number(tris, q)) > 0.5)  # fmt: skip
        except Exception as e:
            item.error = f"occupancy failed: {type(e).__name__}: {e}"
            return item, None
    meta = {"vertices": sum(len(m.vertices) for m in parts), "faces": sum(len(m.faces) for m in parts),
            "bounds": [lo.tolist(), hi.tolist()], "center": center.tolist(), "scale": scale,
            "points": opts.points, "occupancy": opts.occupancy, "color": "/".join(sorted(kinds)),
            "parts": len(parts), "source": item.source}  # fmt: skip
    sample = {"__key__": f"{item.index:09d}", "npy": _npy(arr.astype(np.float16)), "txt": item.caption}
    if occ is not None:
        sample["occ.npy"] = _npy(occ)
    sample["json"] = json.dumps(meta, sort_keys=True)
    return item, sample


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


class MeshWork:
    def __init__(self, opts: MeshOpts):
        self.opts = opts

    def __call__(self, item: Item):
        return process_mesh(item, self.opts)
