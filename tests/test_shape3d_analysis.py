"""The 3-D point-cloud judge: near-perfect on real synthetic clouds (dense, sparse, noisy), and it
says "not sure" or a different shape, never the asked one, for clouds that are not that shape."""

import time

import numpy as np
import pytest

from data import shapes3d as S3
from data import synth_3d as T
from data.shape3d_analysis import analyse, score

N_CLOUDS = 504


@pytest.fixture(scope="module")
def real():
    """(clouds (P=2048), attrs) of train and held-out samples in their natural mix."""
    clouds, attrs = [], []
    for i in range(N_CLOUDS):
        a = T.sample_attrs_3d("train" if i % 4 else "heldout", i, 0)
        cloud, _ = T.sample_arrays_3d(a, points=2048, occupancy=0)
        clouds.append(cloud.astype(np.float64))
        attrs.append(a)
    return clouds, attrs


def _noisy(clouds, n, seed=1):
    rng = np.random.default_rng(seed)
    return [np.column_stack([c[:n, :3] + rng.normal(0, 0.01, (len(c[:n]), 3)), c[:n, 3:]]) for c in clouds]


def _check(s, min_acc=0.98):
    assert s["colour_acc"] == 1.0, s
    assert s["shape_acc"] >= min_acc, s
    assert min(s["per_shape"].values()) >= 0.95, s
    assert set(s["per_shape"]) == set(S3.SHAPES3D)
    for k in ("size_acc", "aspect_acc", "position_acc"):
        assert s[k] >= 0.97, (k, s)


def test_noisy_clouds_2048_and_256_points(real):
    # Gaussian noise of 0.01 on xyz (a generator's imperfect output), dense and sparse (the first
    # 256 rows: a uniform subsample, as a small model would output).
    clouds, attrs = real
    s = score(_noisy(clouds, 2048), attrs)
    _check(s)
    assert s["n"] == N_CLOUDS and sum(sum(r.values()) for r in s["confusion"].values()) == N_CLOUDS
    _check(score(_noisy(clouds, 256, seed=2), attrs))


def test_clean_clouds(real):
    clouds, attrs = real
    few = N_CLOUDS // 4
    t = time.perf_counter()
    _check(score(clouds[:few], attrs[:few]))
    per_cloud = (time.perf_counter() - t) / few
    assert per_cloud < 0.05  # ~5 ms on one core; generous for loaded machines
    _check(score([c[:256] for c in clouds[:few]], attrs[:few]))


def test_wrong_label_is_not_accepted(real):
    clouds, attrs = real
    picked = [(c, a) for c, a in zip(clouds, attrs) if a["shape"] in ("cube", "capsule")][:20]
    lies = [{**a, "shape": "cylinder" if a["shape"] == "cube" else "sphere", "colour": "green"} for _, a in picked]
    s = score([c for c, _ in picked], lies)
    assert s["shape_acc"] == 0.0 and s["both_acc"] == 0.0
    assert s["colour_acc"] == sum(a["colour"] == "green" for _, a in picked) / len(picked)
    assert sum(s["confusion"].get("cylinder", {}).values()) + sum(s["confusion"].get("sphere", {}).values()) == 20
    assert "cube" in s["confusion"]["cylinder"] and "capsule" in s["confusion"]["sphere"]


def test_near_miss_shapes(real):
    # The pairs that differ least: each analysed as itself, not as its neighbour.
    clouds, attrs = real
    for want, other in (("capsule", "cylinder"), ("cylinder", "capsule"), ("cone", "pyramid"), ("pyramid", "cone"),
                        ("sphere", "capsule"), ("torus", "cylinder")):  # fmt: skip
        got = [analyse(c) for c in [c for c, a in zip(clouds, attrs) if a["shape"] == want][:10]]
        assert all(g["shape"] == want for g in got), want
        assert all(g["residuals"][want] < g["residuals"][other] for g in got), (want, other)


def test_clouds_that_are_no_primitive():
    rng = np.random.default_rng(0)
    red = np.array(S3.COLOURS["red"]) / 255.0

    def cloud(xyz):
        return np.column_stack([xyz, np.tile(red, (len(xyz), 1))])

    sphere = rng.normal(size=(1024, 3))
    sphere = sphere / np.linalg.norm(sphere, axis=1, keepdims=True) * 0.1
    a = T.sample_attrs_3d("train", 0, 0)
    whole, _ = T.sample_arrays_3d(a, 2048, 0)
    whole = whole.astype(np.float64)
    bad = {
        "uniform filled box": rng.uniform(-0.2, 0.2, (2048, 3)),
        "gaussian blob": rng.normal(0, 0.1, (2048, 3)),
        "two spheres": np.concatenate([sphere - [0.2, 0, 0], sphere + [0.2, 0, 0]]),
        "top half of a shape": whole[whole[:, 2] > np.median(whole[:, 2]), :3],
        "far too noisy": whole[:, :3] + rng.normal(0, 0.05, whole[:, :3].shape),
    }
    for name, xyz in bad.items():
        r = analyse(cloud(xyz))
        assert r["shape"] is None, (name, r["residual"], r["coverage"])
        assert r["colour"] == "red"
    # The good cloud is accepted, and a few stray points do not change that.
    assert analyse(whole)["shape"] == a["shape"]
    stray = np.column_stack([rng.uniform(-0.5, 0.5, (40, 3)), np.tile(whole[0, 3:], (40, 1))])
    assert analyse(np.concatenate([whole[:2008], stray]))["shape"] == a["shape"]


def test_colour_and_degenerate_inputs(real):
    clouds, attrs = real
    c = clouds[0].copy()
    c[:, 3:] = np.array(S3.COLOURS["blue"]) / 255.0
    assert analyse(c)["colour"] == "blue" and analyse(c)["shape"] == attrs[0]["shape"]
    c[:, 3:] = 0.5  # grey: no palette colour
    assert analyse(c)["colour"] is None
    for junk in (np.zeros((0, 6)), np.zeros((5, 6)), np.full((100, 6), np.nan), np.zeros((10, 3)), np.zeros(6)):
        r = analyse(junk)
        assert r["shape"] is None and r["colour"] is None
    c = clouds[1].copy()
    c[:50] = np.nan  # non-finite rows are dropped, the rest still judged
    assert analyse(c)["shape"] == attrs[1]["shape"]
    assert analyse(clouds[2]) == analyse(clouds[2].copy())  # deterministic
    with pytest.raises(ValueError):
        score(clouds[:2], attrs[:1])
