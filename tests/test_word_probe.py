"""The eval word probes of text2image and text2video (common.diffusion.text_conditioned.word_probe)
on held-out synthetic shards, with stand-in denoisers whose answer is known: the captions each
pipeline builds (the true one must be the stored caption), the truth it scores against."""
from __future__ import annotations

import argparse
import json
import os
import re
import types

import pytest
import torch

from common.config import ConfigError
from common.data.captions import caption_of, read_attributes
from common.data.images import ImageDecoder
from common.data.shards import iter_samples
from common.diffusion import RectifiedFlow
from common.diffusion.text_conditioned import PROBE_TIMES
from data import shapes
from pipelines.text2image import eval as t2i_eval
from pipelines.text2video import eval as t2v_eval
from tests.conftest import shared_once


class _KnownCaptions(torch.nn.Module):
    """Caption -> one-hot row: each known caption its own, every other caption the last row."""

    def __init__(self, captions):
        super().__init__()
        self.index = {c: i for i, c in enumerate(captions)}

    def forward(self, captions):
        rows = torch.tensor([self.index.get(c, len(self.index)) for c in captions])
        ctx = torch.nn.functional.one_hot(rows, len(self.index) + 1).float()[:, None]
        return ctx, torch.ones(len(captions), 1, dtype=torch.bool)


class _FlowOracle(torch.nn.Module):
    """The exact velocity towards clean[caption row]: error 0 under the caption an image was stored with."""

    def __init__(self, clean):
        super().__init__()
        self.clean = clean

    def forward(self, x_t, t, ctx, mask):
        x0 = self.clean[ctx[:, 0].argmax(1)]
        tb = t.view(-1, *[1] * (x0.dim() - 1))
        return (x_t - (1 - tb) * x0) / tb - x0


def _probe(shards, model, tower, n, times=PROBE_TIMES):
    comp = types.SimpleNamespace(cfg=types.SimpleNamespace(model=types.SimpleNamespace(image_size=32)),
                                 model=model, text_encoder=tower, objective=RectifiedFlow(), vae=None)
    result = {}
    lines = t2i_eval.word_probe(argparse.Namespace(word_probe=n, shards=shards, seed=0, word_probe_times=times), comp,
                                result)
    return result["word_probe"], lines


def test_word_probe_reads_the_stored_words_of_an_oracle_and_nothing_from_a_blind_model(synth_data):
    shards = os.path.join(synth_data, "heldout")
    samples = [s for _, s in zip(range(8), iter_samples(shards))]
    captions = [caption_of(s) for s in samples]
    clean = torch.stack([ImageDecoder(32)(s)["image"] for s in samples] + [torch.zeros(3, 32, 32)])

    # The swapped captions are rebuilt from each sample's template: the true one must equal the
    # stored caption exactly, or the oracle (which knows only stored captions) would miss it.
    probe, lines = _probe(shards, _FlowOracle(clean), _KnownCaptions(captions), 8)
    assert probe["n"] == 8 and len(probe["times"]) == len(probe["shape"]["per_time"])
    for word in ("shape", "colour"):
        assert probe[word]["accuracy"] == 1.0 and set(probe[word]["per_time"]) == {1.0}, probe
    assert "shape 100.0% (chance 16.7%" in lines[0] and "colour 100.0% (chance 12.5%" in lines[0]
    # Up to pure noise (t = 1), where the oracle's prediction is set by the caption alone.
    probe, lines = _probe(shards, _FlowOracle(clean), _KnownCaptions(captions), 8, times=[0.9, 1.0])
    assert probe["times"] == [0.9, 1.0] and probe["shape"]["per_time"] == [1.0, 1.0], probe
    assert "t = 0.9/1," in lines[0]

    # Caption-blind: every candidate gets the same error, the argmin is the first word, and the
    # figure is the share of images whose word happens to be first, not 100%.
    attrs = [read_attributes(s) for s in samples]
    probe, _ = _probe(shards, _FlowOracle(clean), _KnownCaptions([]), 8)
    for word, vocabulary in (("shape", shapes.SHAPES), ("colour", list(shapes.COLOURS))):
        first = sum(a[word] == vocabulary[0] for a in attrs) / len(attrs)
        assert probe[word]["accuracy"] == pytest.approx(first) and first < 1.0


def test_word_probe_refuses_shards_without_synthetic_attributes(monkeypatch):
    monkeypatch.setattr("common.data.shards.iter_samples", lambda _: iter([{"txt": b"a photo", "png": b""}]))
    with pytest.raises(ConfigError, match=r"--word-probe \(data.synth images\): the held-out shards have no samples"):
        _probe("unused", None, None, 4)


def test_first_decoded_skips_unqualified_samples_and_stops_at_the_nth(monkeypatch):
    from common.data.captions import first_decoded

    def sample(i, **attrs):
        return {"txt": f"c{i}".encode(), "json": json.dumps(attrs).encode(), "i": i}
    stream = [sample(0), sample(1, shape="disc"), sample(2, shape="disc", colour="red"),
              sample(3, shape="disc", colour="red"), sample(4, shape="disc", colour="red")]

    def samples(_):
        yield from stream
        raise AssertionError("read a sample past the n-th that qualifies")
    monkeypatch.setattr("common.data.shards.iter_samples", samples)
    decode = (lambda s: None if s["i"] == 3 else {"caption": caption_of(s), "x": torch.full((2,), float(s["i"]))})
    x, attrs, captions = first_decoded("unused", 2, {"shape", "colour"}, decode, "x", "--opt")
    assert captions == ["c2", "c4"] and x[:, 0].tolist() == [2.0, 4.0] and attrs[0] == {"shape": "disc", "colour": "red"}


@pytest.fixture(scope="module")
def heldout_clips(tmp_path_factory):
    from data.synth_video import generate_video
    return os.path.join(shared_once(tmp_path_factory, "synth-video-probe", lambda out: generate_video(
        out, count=8, heldout_count=8, size=16, frames=4, shard_size=8, seed=0)), "heldout")


def test_video_word_probe_reads_motion_shape_and_colour_of_an_oracle(heldout_clips):
    from pipelines.text2video.data import ClipDecoder
    samples = list(iter_samples(heldout_clips))
    decoded = [ClipDecoder(4, (16, 16))(s) for s in samples]
    clean = torch.stack([d["video"] for d in decoded] + [torch.zeros_like(decoded[0]["video"])])
    comp = types.SimpleNamespace(pixel_clip_shape=(4, 16, 16), model=_FlowOracle(clean),
                                 text_encoder=_KnownCaptions([d["caption"] for d in decoded]),
                                 objective=RectifiedFlow(), vae=None)
    result = {}
    lines = t2v_eval.word_probe(argparse.Namespace(word_probe=8, shards=heldout_clips, seed=0,
                                                   word_probe_times=PROBE_TIMES), comp, result)
    probe = result["word_probe"]
    assert probe["n"] == 8 and "word probe on 8 held-out real clips" in lines[0]
    for word in ("motion", "shape", "colour"):
        assert probe[word]["accuracy"] == 1.0 and set(probe[word]["per_time"]) == {1.0}, probe
    assert probe["motion"]["chance"] == pytest.approx(1 / 7)
    # Swapping the motion changes its phrase only: the rest of the caption stays as stored.
    a, caption = read_attributes(samples[0]), decoded[0]["caption"]
    other = next(m for m in t2v_eval.MOTIONS if m != a["motion"])
    swapped = t2v_eval._swapped("motion")(a, other)
    assert swapped != caption and swapped.replace(t2v_eval.MOTIONS[other][a["phrase"]], "") == \
        caption.replace(t2v_eval.MOTIONS[a["motion"]][a["phrase"]], "")


def test_word_probe_refuses_a_rewrite_that_does_not_give_back_the_stored_caption():
    from common.diffusion.text_conditioned import word_probe
    attrs = [{"shape": "circle"}]
    rewrite = lambda a, w: f"{w}"  # noqa: E731  (drops the article the stored caption has)
    with pytest.raises(ValueError, match="not the item's caption 'a circle'"):
        word_probe(None, None, RectifiedFlow(), torch.zeros(1, 3, 4, 4), attrs, ["a circle"],
                   {"shape": (["circle", "square"], rewrite)})


def test_noise_level_lists_are_checked_at_the_command_line():
    from common.cli import noise_levels_arg
    assert noise_levels_arg()("0.6, 0.9,1") == [0.6, 0.9, 1.0] and noise_levels_arg()("") == []
    for text, message in (("", "at least one"), ("0,0.5", "(0, 1]"), ("0.5,1.2", "(0, 1]"), ("x", "numbers")):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
            noise_levels_arg(allow_empty=False)(text)
