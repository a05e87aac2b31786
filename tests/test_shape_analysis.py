"""The pixel analyser reads colour and shape back from real synthetic shards, and fails soft."""

import glob
import io
import json
import os

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from data import shapes as S
from data import synth
from data.shape_analysis import analyse, diversity_ratio, drawn_summary, mean_pairwise_distance, score


@pytest.fixture(scope="module")
def decoded(tmp_path_factory):
    """~576 images read back from shards at three sizes, both splits: the real pipeline path."""
    images, attrs = [], []
    for size, seed in ((32, 11), (48, 12), (64, 13)):
        out = str(tmp_path_factory.mktemp(f"syn{size}"))
        synth.generate(out, count=144, heldout_count=48, size=size, shard_size=100, seed=seed)
        urls = sorted(glob.glob(os.path.join(out, "*", "*.tar")))
        for s in wds.WebDataset(urls, shardshuffle=False):
            images.append(np.asarray(Image.open(io.BytesIO(s["png"])).convert("RGB")))
            attrs.append(json.loads(s["json"]))
    return images, attrs


def test_accuracy_on_synthetic_images(decoded):
    images, attrs = decoded
    assert len(images) >= 500
    assert {a["image_size"] for a in attrs} == {32, 48, 64}
    assert {a["split"] for a in attrs} == {"train", "heldout"}
    r = score(images, attrs)
    print(f"\nanalyser on {r['n']} synthetic images: colour {r['colour_acc']:.4f}, "
          f"shape {r['shape_acc']:.4f}, both {r['both_acc']:.4f}")  # fmt: skip
    assert r["n"] == len(images)
    assert r["colour_acc"] >= 0.98 and r["shape_acc"] >= 0.98
    # Every shape and colour is exercised, not just the easy ones.
    assert {a["shape"] for a in attrs} == set(S.SHAPES) and {a["colour"] for a in attrs} == set(S.COLOURS)


def test_background_and_placement(decoded):
    images, attrs = decoded
    for img, a in list(zip(images, attrs))[::10]:
        r = analyse(img)
        assert r["background"] == a["background"] and r["confident"]
        assert abs(r["cx"] - a["cx"]) < 0.05 and abs(r["cy"] - a["cy"]) < 0.05
        assert abs(r["radius"] / a["radius"] - 1) < 0.15


def test_score_counts_wrong_labels():
    a = synth.sample_attrs("train", 0, 0, 32)
    img = synth.render_sample(a)
    other_shape = next(s for s in S.SHAPES if s != a["shape"])
    r = score([img, img], [a, {**a, "shape": other_shape}])
    assert r == {"colour_acc": 1.0, "shape_acc": 0.5, "both_acc": 0.5, "n": 2, "drawn": {a["shape"]: 2}}
    assert score([], [])["n"] == 0


def test_score_tallies_the_shapes_drawn():
    """A model that draws one shape whatever the prompt shows as one shape in `drawn`."""
    a = synth.sample_attrs("train", 0, 0, 32)
    img = synth.render_sample(a)
    blank = np.full_like(img, 128)
    asked = [{**a, "shape": s} for s in S.SHAPES]
    r = score([img] * len(asked) + [blank], asked + [a])
    assert r["drawn"] == {a["shape"]: len(asked), "none": 1}
    assert r["shape_acc"] == pytest.approx(1 / (len(asked) + 1))
    assert drawn_summary(r["drawn"], top=1) == f"{a['shape']} {len(asked) / (len(asked) + 1):.0%}"


@pytest.mark.parametrize("bg", list(S.BACKGROUNDS))
def test_blank_image_has_no_shape(bg):
    img = np.zeros((32, 32, 3), np.uint8) + np.array(S.BACKGROUNDS[bg], np.uint8)
    r = analyse(img)
    assert r["shape"] is None and r["colour"] is None and not r["confident"]
    assert r["background"] == bg


def test_noise_and_odd_inputs_do_not_crash():
    rng = np.random.default_rng(0)
    for size in (8, 32, 64):
        r = analyse(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
        assert not r["confident"]
    # Model outputs: float in [0,1], CHW, grey, RGBA, NaN, non-square, tiny, empty.
    a = synth.sample_attrs("train", 3, 0, 32)
    img = synth.render_sample(a)
    assert analyse(img.astype(np.float32) / 255)["shape"] == a["shape"]
    assert analyse(np.moveaxis(img, -1, 0))["colour"] == a["colour"]
    for odd in (img[..., 0], np.dstack([img, img[..., :1]]), np.full((32, 32, 3), np.nan),
                img[:, :20], np.zeros((2, 2, 3), np.uint8), np.zeros((0, 0, 3)), None):  # fmt: skip
        analyse(odd)


def test_mild_noise_degrades_gracefully():
    # Generated images are noisy: mild noise must not flip answers; heavy noise may give None
    # but should rarely give a confident wrong shape.
    rng = np.random.default_rng(1)
    right = wrong = 0
    for i in range(60):
        a = synth.sample_attrs("train", i, 2, 32)
        img = synth.render_sample(a).astype(np.float64)
        r = analyse(np.clip(img + rng.normal(0, 8, img.shape), 0, 255).astype(np.uint8))
        right += r["shape"] == a["shape"] and r["colour"] == a["colour"]
        wrong += r["shape"] is not None and r["shape"] != a["shape"]
    assert right >= 57 and wrong <= 2


def test_mean_pairwise_distance_is_the_mean_rms_over_pairs():
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (9, 7, 3), dtype=np.uint8) for _ in range(6)]
    pairs = [np.sqrt(((images[i].astype(np.float64) - images[j]) ** 2).mean())
             for i in range(6) for j in range(i + 1, 6)]
    assert mean_pairwise_distance(images) == pytest.approx(np.mean(pairs), rel=1e-9)
    assert mean_pairwise_distance([images[0]] * 4) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError):
        mean_pairwise_distance(images[:1])


def test_diversity_ratio_of_real_images_and_of_a_collapsed_model(decoded):
    """Two halves of one class's real images are about as spread as each other; a 'model' that
    draws one image for every seed scores 0."""
    images, attrs = decoded
    by_class = {}
    for img, a in zip(images, attrs):
        if img.shape[0] == 32:
            by_class.setdefault((a["colour"], a["shape"]), []).append(img)
    real = max(by_class.values(), key=len)
    assert len(real) >= 8
    half = len(real) // 2
    assert 0.7 < diversity_ratio(real[:half], real[half:]) < 1.4
    assert diversity_ratio([real[0]] * 8, real) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="all identical"):  # no real spread: an error, not inf/nan
        diversity_ratio(real[:4], [real[0]] * 4)
