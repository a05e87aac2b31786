"""Vocabulary and geometry of the synthetic coloured 3-D primitives (the 3-D `data/shapes.py`).

Everything that defines what a synthetic 3-D sample can show lives here, so the generator
(`data/synth_3d.py`), the point-cloud analyser (`data/shape3d_analysis.py`) and any evaluation agree
by construction.

Frame: z is up, and every primitive lies inside [-0.5, 0.5]^3 in one shared scene frame (clouds are
not re-normalised per shape, so size and position stay readable). Primitives are axis-aligned and
upright; "size" is the largest side of the axis-aligned bounding box, "aspect" the ratio
height / width of that box, and the position is the box centre (x named, y = z = 0).

Each shape has a fixed parameter vector (`THETA_NAMES`), which the analytic signed distance
(`sdf_theta`) evaluates for many parameter sets at once: the analyser fits by finite differences
with one call per step.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from data.shapes import COLOURS  # the 3-D vocabulary uses the same palette (re-exported)

SHAPES3D: list[str] = ["sphere", "cube", "cylinder", "cone", "torus", "pyramid", "capsule"]

# Largest bounding-box side. Neighbours are 1.4x apart so a +-6% jitter never blurs the names.
SIZES3D: dict[str, float] = {"small": 0.30, "medium": 0.42, "large": 0.56}
SIZE_JITTER = 0.06  # relative

# Centre of the bounding box along x (y = z = 0) and the caption phrase. 0.2 + 0.56 * 1.06 / 2 <
# 0.5: the largest shape still fits in the box at either side.
POSITIONS3D: dict[str, tuple[float, str]] = {
    "left": (-0.2, "on the left"),
    "centre": (0.0, "in the centre"),
    "right": (0.2, "on the right"),
}
POSITION_JITTER = 0.02  # along x; half the gap between neighbours is 0.1

# Height / width of the bounding box, per shape; sphere and torus have no aspect. Ratios 2x apart
# (1.25x for the capsule) so bounding boxes alone name them. A capsule is always taller than wide
# (at 1:1 it would be a sphere) but not thinner than 2.5:1: a small 3:1 capsule is so thin that
# with 0.01 noise on 256 points its caps no longer tell it from a cylinder.
ASPECTS3D: dict[str, dict[str, float]] = {
    "sphere": {},
    "cube": {"flat": 0.5, "regular": 1.0, "tall": 2.0},
    "cylinder": {"flat": 0.5, "regular": 1.0, "tall": 2.0},
    "cone": {"flat": 0.5, "regular": 1.0, "tall": 2.0},
    "torus": {},
    "pyramid": {"flat": 0.5, "regular": 1.0, "tall": 2.0},
    "capsule": {"regular": 2.0, "tall": 2.5},
}
ASPECT_JITTER = 0.05  # relative
TORUS_TUBE = 0.4  # tube radius / major radius: a clear hole, and a tube thick enough to sample

# Colour jitter of a sample, per channel in 0..255: far below the ~100 between palette colours.
COLOUR_JITTER = 4

# (shape, colour) pairs never in the training split: each shape once, each with its own colour, so
# every shape and every colour is still seen in training with other partners.
HELDOUT_COMBOS3D: list[tuple[str, str]] = [
    ("sphere", "orange"),
    ("cube", "magenta"),
    ("cylinder", "yellow"),
    ("cone", "blue"),
    ("torus", "green"),
    ("pyramid", "cyan"),
    ("capsule", "red"),
]

# The parameter vector of each shape (after the centre cx, cy, cz); all lengths in scene units.
THETA_NAMES: dict[str, tuple[str, ...]] = {
    "sphere": ("radius",),
    "cube": ("hx", "hy", "hz"),  # half extents
    "cylinder": ("radius", "half_height"),
    "cone": ("radius", "half_height"),  # base disk at cz - h, apex at cz + h
    "torus": ("radius", "tube_radius"),  # major radius, axis z
    "pyramid": ("half_width", "half_height"),  # square base at cz - h, apex at cz + h
    "capsule": ("radius", "half_height"),  # half of the total height, caps included
}


def train_combos3d() -> list[tuple[str, str]]:
    held = set(HELDOUT_COMBOS3D)
    return [(s, c) for s in SHAPES3D for c in COLOURS if (s, c) not in held]


def _check_shape(shape: str) -> None:
    if shape not in SHAPES3D:
        raise ValueError(f"unknown shape {shape!r}; known: {SHAPES3D}")


def box_size(shape: str, extent: float, ratio: float | None) -> tuple[float, float]:
    """(width, height) of the bounding box of a shape whose largest side is `extent`."""
    _check_shape(shape)
    if shape == "sphere":
        return extent, extent
    if shape == "torus":
        return extent, extent * TORUS_TUBE / (1.0 + TORUS_TUBE)
    return (extent / ratio, extent) if ratio >= 1.0 else (extent, extent * ratio)


def primitive(attrs: dict) -> dict:
    """Geometric parameters (JSON-able) of a sample's primitive.

    Reads the numeric `max_extent`, `ratio` and `center` of sampled attributes when present, else the
    nominal values of the `size`, `aspect` and `position` names. Returns {"center": [x, y, z],
    "extent": [wx, wy, wz] (bounding box), plus the shape's THETA_NAMES lengths in readable form}:
    sphere radius; cube half_extents; cylinder / cone / capsule radius and height (total); torus
    radius and tube_radius; pyramid half_width and height.
    """
    shape = attrs["shape"]
    _check_shape(shape)
    extent = float(attrs.get("max_extent") or SIZES3D[attrs["size"]])
    ratio = attrs.get("ratio")
    if ratio is None and ASPECTS3D[shape]:
        ratio = ASPECTS3D[shape][attrs["aspect"]]
    center = attrs.get("center")
    if center is None:
        center = [POSITIONS3D[attrs["position"]][0], 0.0, 0.0]
    w, h = box_size(shape, extent, ratio)
    p: dict = {"center": [float(c) for c in center], "extent": [w, w, h]}
    if shape == "sphere":
        p["radius"] = w / 2
    elif shape == "cube":
        p["half_extents"] = [w / 2, w / 2, h / 2]
    elif shape == "torus":
        p["tube_radius"] = h / 2
        p["radius"] = w / 2 - h / 2
    elif shape == "pyramid":
        p["half_width"], p["height"] = w / 2, h
    else:  # cylinder, cone, capsule
        p["radius"], p["height"] = w / 2, h
    return p


def params_to_theta(shape: str, params: dict) -> np.ndarray:
    """`primitive` dict -> the shape's parameter vector (cx, cy, cz, *THETA_NAMES)."""
    _check_shape(shape)
    c = list(params["center"])
    if shape == "sphere":
        rest = [params["radius"]]
    elif shape == "cube":
        rest = list(params["half_extents"])
    elif shape == "torus":
        rest = [params["radius"], params["tube_radius"]]
    elif shape == "pyramid":
        rest = [params["half_width"], params["height"] / 2]
    else:
        rest = [params["radius"], params["height"] / 2]
    return np.asarray(c + rest, dtype=np.float64)


def theta_to_params(shape: str, theta) -> dict:
    """Inverse of `params_to_theta` (also fills "extent")."""
    t = [float(v) for v in theta]
    c, rest = t[:3], t[3:]
    p: dict = {"center": c}
    if shape == "sphere":
        p["radius"] = rest[0]
        p["extent"] = [2 * rest[0]] * 3
    elif shape == "cube":
        p["half_extents"] = rest
        p["extent"] = [2 * v for v in rest]
    elif shape == "torus":
        p["radius"], p["tube_radius"] = rest
        w = 2 * (rest[0] + rest[1])
        p["extent"] = [w, w, 2 * rest[1]]
    else:
        key = "half_width" if shape == "pyramid" else "radius"
        p[key], p["height"] = rest[0], 2 * rest[1]
        p["extent"] = [2 * rest[0], 2 * rest[0], 2 * rest[1]]
    return p


# ------------------------------------------------------------------------------ signed distance
def _norm2(a, b):
    return np.sqrt(a * a + b * b)  # np.hypot is ~8x slower on small arrays, and overflow is moot


def sdf_theta(shape: str, theta: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Exact signed distance (negative inside) of K parameter sets at M points: (K, M).

    theta: (K, 3 + len(THETA_NAMES[shape])); points: (M, 3).
    """
    _check_shape(shape)
    th = np.asarray(theta, dtype=np.float64)
    p = np.asarray(points, dtype=np.float64)
    x = p[None, :, 0] - th[:, 0:1]
    y = p[None, :, 1] - th[:, 1:2]
    z = p[None, :, 2] - th[:, 2:3]
    s = [th[:, k : k + 1] for k in range(3, th.shape[1])]
    if shape == "sphere":
        return np.sqrt(x * x + y * y + z * z) - s[0]
    if shape == "cube":
        dx, dy, dz = np.abs(x) - s[0], np.abs(y) - s[1], np.abs(z) - s[2]
        out = np.sqrt(np.maximum(dx, 0) ** 2 + np.maximum(dy, 0) ** 2 + np.maximum(dz, 0) ** 2)
        return out + np.minimum(np.maximum(np.maximum(dx, dy), dz), 0.0)
    rho = np.sqrt(x * x + y * y)
    if shape == "cylinder":
        dr, dz = rho - s[0], np.abs(z) - s[1]
        return _norm2(np.maximum(dr, 0), np.maximum(dz, 0)) + np.minimum(np.maximum(dr, dz), 0.0)
    if shape == "capsule":
        half_seg = np.maximum(s[1] - s[0], 0.0)
        return np.sqrt(rho * rho + (z - np.clip(z, -half_seg, half_seg)) ** 2) - s[0]
    if shape == "torus":
        return _norm2(rho - s[0], z) - s[1]
    if shape == "cone":
        # 2-D in the (rho, z) half plane: the triangle (0, -h), (r, -h), (0, h); the axis is no
        # surface, so the distance is to the base segment or the slant segment.
        r, h = s
        zb = z + h
        d_base = _norm2(np.maximum(rho - r, 0.0), zb)
        vr, vz = -r, 2 * h
        t = np.clip(((rho - r) * vr + zb * vz) / (vr * vr + vz * vz), 0.0, 1.0)
        d_slant = _norm2(rho - r - t * vr, zb - t * vz)
        inside = (zb > 0) & (rho * 2 * h + r * zb < 2 * r * h)
        return np.where(inside, -1.0, 1.0) * np.minimum(d_base, d_slant)
    if shape == "pyramid":
        # Fold by the 8 symmetries of the square: with u >= v >= 0 the nearest surface point is on
        # the +u face or the base. The face in its own plane: s runs from the base edge (s = 0) up
        # the slant to the apex (s = L), v along the edge; folded, the triangle is
        # 0 <= v <= a (1 - s / L), and only its base edge and slant edge are surface.
        a, h = s
        ax, ay = np.abs(x), np.abs(y)
        u, v = np.maximum(ax, ay), np.minimum(ax, ay)
        slant = np.sqrt(4 * h * h + a * a)
        wu, wz = u - a, z + h
        t_n = (wu * 2 * h + wz * a) / slant  # height above the face plane
        s_ = (-wu * a + wz * 2 * h) / slant
        # Slant edge from (s, v) = (0, a) to (L, 0); the base edge is s = 0, 0 <= v <= a.
        k = np.clip((s_ * slant - (v - a) * a) / (slant * slant + a * a), 0.0, 1.0)
        d_slant = _norm2(s_ - k * slant, v - a + k * a)
        d_edge = _norm2(s_, np.maximum(v - a, 0.0))
        in_tri = (s_ >= 0) & (v * slant <= a * (slant - s_))
        d2 = np.where(in_tri, 0.0, np.minimum(d_slant, d_edge))
        d_face = np.sqrt(t_n * t_n + d2 * d2)
        d_base = np.sqrt(np.maximum(u - a, 0) ** 2 + np.maximum(v - a, 0) ** 2 + wz * wz)
        inside = (wz > 0) & (u * 2 * h < a * (h - z))
        return np.where(inside, -1.0, 1.0) * np.minimum(d_face, d_base)
    raise AssertionError(shape)


def sdf(shape: str, params: dict, points: np.ndarray) -> np.ndarray:
    """Signed distance (M,) of `points` (M, 3) to the primitive `params` (`primitive`'s dict),
    negative inside."""
    return sdf_theta(shape, params_to_theta(shape, params)[None], points)[0]


# ---------------------------------------------------------------------------------------- meshes
@lru_cache(maxsize=None)
def _unit_mesh(shape: str) -> tuple[np.ndarray, np.ndarray]:
    """(vertices, faces) of a unit primitive, built once: a sample's mesh is an affine map of it,
    which is much cheaper than re-tessellating. Unit: radius / half extents 1, z in [-1, 1] (the
    torus: major radius 1; the capsule: hemispheres centred at z = +-1)."""
    from trimesh import creation

    if shape == "sphere":
        m = creation.icosphere(subdivisions=4)
    elif shape == "cube":
        m = creation.box(extents=[2, 2, 2])
    elif shape == "cylinder":
        m = creation.cylinder(radius=1.0, height=2.0, sections=64)
    elif shape == "cone":
        m = creation.cone(radius=1.0, height=2.0, sections=64)
        m.apply_translation([0, 0, -1])  # trimesh puts the base at z = 0
    elif shape == "torus":
        m = creation.torus(1.0, TORUS_TUBE, major_sections=96, minor_sections=32)
    elif shape == "pyramid":
        v = np.array([[-1, -1, -1], [1, -1, -1], [1, 1, -1], [-1, 1, -1], [0, 0, 1]], dtype=np.float64)
        f = np.array([[0, 2, 1], [0, 3, 2], [0, 1, 4], [1, 2, 4], [2, 3, 4], [3, 0, 4]])  # outward normals
        return v, f
    else:
        m = creation.capsule(height=2.0, radius=1.0, count=[32, 64])
    return np.asarray(m.vertices, dtype=np.float64), np.asarray(m.faces, dtype=np.int64)


def place(shape: str, params: dict, unit_points: np.ndarray) -> np.ndarray:
    """Map points of the unit primitive (`_unit_mesh`'s frame) onto the primitive `params`."""
    v = np.asarray(unit_points, dtype=np.float64)
    if shape == "torus":
        v = v * params["radius"]  # the tube ratio is fixed: a uniform scale
    elif shape == "capsule":
        # Scale the hemispheres by the radius, then move each one to its end of the straight part.
        r, half_seg = params["radius"], params["height"] / 2 - params["radius"]
        z = np.sign(v[:, 2]) * ((np.abs(v[:, 2]) - 1.0) * r + half_seg)
        v = np.column_stack([v[:, :2] * r, z])
    else:
        v = v * (np.asarray(params["extent"], dtype=np.float64) / 2)
    return v + np.asarray(params["center"], dtype=np.float64)


@lru_cache(maxsize=None)
def unit_surface_points(shape: str, count: int = 256) -> np.ndarray:
    """A fixed (seeded) area-uniform sample of the unit primitive's surface, (count, 3): with `place`,
    points spread over any primitive's surface (the analyser's coverage check)."""
    import trimesh

    v, f = _unit_mesh(shape)
    pts, _ = trimesh.sample.sample_surface(trimesh.Trimesh(v, f, process=False), count, seed=0)
    pts.setflags(write=False)
    return pts


def build_mesh(attrs: dict, rng: np.random.Generator | None = None):
    """Watertight trimesh.Trimesh of the primitive in the scene frame, every face the sample's colour.

    The colour is attrs["rgb"] when given, else the named colour, jittered by up to COLOUR_JITTER
    per channel when `rng` is given. The tessellation (at most ~6k faces) stays within ~0.1% of the
    size of the analytic surface, so mesh and `sdf` agree on inside / outside almost everywhere.
    """
    import trimesh

    shape = attrs["shape"]
    v, faces = _unit_mesh(shape)
    m = trimesh.Trimesh(vertices=place(shape, primitive(attrs), v), faces=faces, process=False)
    rgb = np.asarray(attrs.get("rgb") or COLOURS[attrs["colour"]], dtype=np.int64)
    if rng is not None:
        rgb = rgb + rng.integers(-COLOUR_JITTER, COLOUR_JITTER + 1, size=3)
    rgba = np.append(np.clip(rgb, 0, 255), 255).astype(np.uint8)
    m.visual = trimesh.visual.ColorVisuals(m, face_colors=np.tile(rgba, (len(faces), 1)))
    return m
