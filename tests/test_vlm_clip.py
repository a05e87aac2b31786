"""Stage 0 of the vlm pipeline (pipelines/vlm/clip.py): the CLIP decoder, config checks, the
data-parallel loss/gradient identity of open_clip's ClipLoss with gathered features, vision tokens
for the later stages, and the zero-shot metrics on a case whose answers are known."""
from __future__ import annotations

import io
import pickle
import socket

import numpy as np
import pytest
import torch
from PIL import Image

from common.config import ConfigError
from dist_harness import run_ranks
from pipelines.vlm.clip import (ClipConfig, ClipDecoder, ClipTrainModel, build_clip, build_tokenizer, class_prompts,
                                clip_criterion, clip_step_fns, format_zero_shot, preprocess_stats, vision_tokens,
                                zero_shot)

# Small enough that a forward/backward takes milliseconds on one core.
TINY = dict(image_size=16, patch_size=8, width=32, layers=2, heads=2, text_width=32, text_layers=1, text_heads=2,
            context_length=16, embed_dim=16)


def tiny_cfg(**kw) -> ClipConfig:
    return ClipConfig(**{**TINY, **kw})


def png_bytes(rgb, size: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((size, size, 3), rgb, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


# --------------------------------------------------------------------------- decoder and config
def test_decoder_normalises_resizes_and_tokenises(monkeypatch):
    def no_network(*a, **k):
        raise AssertionError("network access attempted")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)

    cfg = tiny_cfg()
    dec = pickle.loads(pickle.dumps(ClipDecoder(cfg)))  # loader workers receive a pickled copy
    rgb = (200, 40, 120)
    for ext, size in (("png", 16), ("png", 40), ("jpg", 16)):
        raw = png_bytes(rgb, size)
        if ext == "jpg":
            buf = io.BytesIO()
            Image.open(io.BytesIO(raw)).save(buf, format="JPEG", quality=100)
            raw = buf.getvalue()
        out = dec({"__key__": "k", ext: raw, "txt": b"two red circles and a blue star\n"})
        assert out["image"].shape == (3, 16, 16) and out["image"].dtype == torch.float32
        mean, std = preprocess_stats(cfg)
        want = (torch.tensor(rgb) / 255.0 - torch.tensor(mean)) / torch.tensor(std)
        tol = 0.05 if ext == "jpg" else 1e-5
        torch.testing.assert_close(out["image"].mean(dim=(1, 2)), want.float(), atol=tol, rtol=0)
        assert out["text"].dtype == torch.int64 and out["text"].shape == (cfg.context_length,)
    tok = build_tokenizer(cfg)
    assert torch.equal(out["text"], tok(["two red circles and a blue star"])[0])
    assert out["text"][0] == tok.sot_token_id and (out["text"] == tok.eot_token_id).sum() == 1
    # the model open_clip builds carries the same statistics the decoder uses
    import open_clip
    pc = open_clip.get_model_preprocess_cfg(build_clip(cfg, seed=0))
    assert (tuple(pc["mean"]), tuple(pc["std"])) == preprocess_stats(cfg)

    with pytest.raises(ValueError, match="caption"):
        dec({"png": png_bytes(rgb, 16)})
    with pytest.raises(ValueError, match="image"):
        dec({"txt": b"a red circle"})


@pytest.mark.parametrize("change, message", [
    ({"image_size": 20}, "multiple of clip.patch_size"),
    ({"heads": 3}, "clip.width=32 must be divisible by clip.heads=3"),
    ({"text_heads": 5}, "clip.text_width=32 must be divisible"),
    ({"layers": 0}, "clip.layers=0 must be > 0"),
    ({"context_length": 2}, "clip.context_length=2 must be >= 3"),
    ({"init_logit_scale": 9.0}, "clip.init_logit_scale"),
    ({"weights": "/nonexistent/clip.pt"}, "is not a file"),
])
def test_config_validation(change, message):
    tiny_cfg().validate()
    with pytest.raises(ConfigError, match=message):
        tiny_cfg(**change).validate()


def test_build_is_seeded_apart_from_global_rng():
    cfg = tiny_cfg()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b, c = build_clip(cfg, seed=5), build_clip(cfg, seed=5), build_clip(cfg, seed=6)
    assert torch.equal(torch.get_rng_state(), before)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["visual.conv1.weight"], sc["visual.conv1.weight"])


def test_weights_file_is_loaded(tmp_path):
    src = build_clip(tiny_cfg(), seed=3)
    path = str(tmp_path / "clip.pt")
    torch.save(src.state_dict(), path)
    cfg = tiny_cfg(weights=path)
    cfg.validate()
    loaded, want = build_clip(cfg, seed=4).state_dict(), src.state_dict()
    assert all(torch.equal(loaded[k], want[k]) for k in want)


# --------------------------------------------------------------------------- data parallel loss
def _batch(cfg: ClipConfig, n: int = 8):
    g = torch.Generator().manual_seed(0)
    images = torch.randn(n, 3, cfg.image_size, cfg.image_size, generator=g, dtype=torch.float64)
    words = ["red", "green", "blue", "circle", "star", "square", "two", "three"]
    captions = [" ".join(words[(i * k) % len(words)] for k in (1, 3, 5)) for i in range(n)]
    return images, build_tokenizer(cfg)(captions)


def _loss_and_grads(cfg: ClipConfig, rank: int = 0, world: int = 1):
    model = ClipTrainModel(build_clip(cfg, seed=7)).double()
    with torch.no_grad():
        model.clip.logit_scale.fill_(1.7)  # away from the init, so its gradient is not special
    images, text = _batch(cfg)
    per = images.shape[0] // world
    prepare, criterion = clip_step_fns(model, "cpu")
    assert criterion is clip_criterion
    inputs, target = prepare({"image": images[rank * per:(rank + 1) * per], "text": text[rank * per:(rank + 1) * per]})
    loss = criterion(model(*inputs), target)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if world > 1:  # what DDP / FSDP do with the gradients: the mean over data-parallel ranks
        for g in grads.values():
            torch.distributed.all_reduce(g)
            g /= world
    return loss.detach(), grads


def _dp_rank(rank, world):
    loss, grads = _loss_and_grads(tiny_cfg(), rank, world)
    # numpy, not tensors: torch's queue would pass tensors as shared memory of an exiting process
    return loss.numpy(), {k: g.numpy() for k, g in grads.items()}


@pytest.mark.dist
def test_data_parallel_loss_and_grads_match_single_process():
    ref_loss, ref_grads = _loss_and_grads(tiny_cfg())
    results = run_ranks(_dp_rank, 2, timeout=180)
    assert len(ref_grads) == sum(1 for _ in ClipTrainModel(build_clip(tiny_cfg(), 0)).parameters())
    for loss, grads in results:
        torch.testing.assert_close(torch.from_numpy(loss), ref_loss, rtol=1e-10, atol=0)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(torch.from_numpy(g), ref_grads[name], rtol=1e-9, atol=1e-12, msg=name)
    assert ref_grads["clip.logit_scale"].abs() > 0 and ref_grads["clip.visual.conv1.weight"].abs().sum() > 0


# --------------------------------------------------------------------------- vision tokens
def test_vision_tokens_shape_and_consistency():
    cfg = tiny_cfg()
    clip = build_clip(cfg, seed=1).eval()
    images = torch.randn(3, 3, cfg.image_size, cfg.image_size)
    tokens = vision_tokens(clip.visual, images)
    num_patches = (cfg.image_size // cfg.patch_size) ** 2
    assert tokens.shape == (3, num_patches, cfg.width)
    assert clip.visual.output_tokens is False  # restored: the CLIP image path is unchanged
    # the same tensor as the final block's output through ln_post without the class token ...
    ref = clip.visual.forward_intermediates(images, indices=1, normalize_intermediates=True,
                                            intermediates_only=True, output_fmt="NLC")["image_intermediates"][-1]
    torch.testing.assert_close(tokens, ref, rtol=0, atol=0)
    # ... of the same transformer pass whose class token gives the pooled CLIP features
    visual = clip.visual
    x = visual.ln_post(visual.transformer(visual._embeds(images)))
    torch.testing.assert_close(tokens, x[:, 1:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(clip.encode_image(images), x[:, 0] @ visual.proj, rtol=1e-5, atol=1e-6)
    # gradients flow into the tower through the tokens
    vision_tokens(clip.visual, images).sum().backward()
    assert clip.visual.transformer.resblocks[-1].mlp.c_proj.weight.grad.abs().sum() > 0


# --------------------------------------------------------------------------- zero-shot
def test_zero_shot_counts_known_answers():
    """Encoders replaced by lookup tables: the image of sample i points at caption r[i], colour
    c[i] and shape s[i]; exactly k of n are right for each task."""
    from data import shapes as S

    colours, shapes = list(S.COLOURS), list(S.SHAPES)
    n = 10
    captions = [f"caption {i}" for i in range(n)]
    captions[9] = captions[8]  # identical captions: retrieving either is correct
    targets = [[colours[i % 8], shapes[i % 6], 1] for i in range(n)]
    pred_caption = [i if i < 7 else (i + 3) % 8 for i in range(n)]  # 7 right, plus sample 9 -> 8 (same text)
    pred_colour = [colours[i % 8] if i < 4 else colours[(i + 1) % 8] for i in range(n)]  # 4 right
    pred_shape = [shapes[i % 6] if i < 6 else shapes[(i + 2) % 6] for i in range(n)]  # 6 right
    pred_caption[9] = 8
    dim = n + len(colours) + len(shapes)

    texts: list[str] = []

    def tokenizer_fn(batch):
        ids = []
        for t in batch:
            if t not in texts:
                texts.append(t)
            ids.append(texts.index(t))
        return torch.tensor(ids)[:, None]

    def text_vec(t: str) -> torch.Tensor:
        v = torch.zeros(dim)
        if t.startswith("caption"):
            v[int(t.split()[1])] = 1.0
            return v
        words = t.split()
        v[n + colours.index(words[1])] = 1.0  # "a red circle", "two red circles"
        shape = next(s for s in shapes if words[2].startswith(s))
        v[n + len(colours) + shapes.index(shape)] = 1.0
        return v

    def encode_text(ids, normalize=False):
        return torch.nn.functional.normalize(torch.stack([text_vec(texts[i]) for i in ids[:, 0].tolist()]), dim=-1)

    def encode_image(images, normalize=False):
        rows = []
        for i in images[:, 0, 0, 0].long().tolist():
            v = torch.zeros(dim)
            v[pred_caption[i]] = 1.0
            v[n + colours.index(pred_colour[i])] = 1.0
            v[n + len(colours) + shapes.index(pred_shape[i])] = 1.0
            rows.append(v)
        return torch.nn.functional.normalize(torch.stack(rows), dim=-1)

    model = ClipTrainModel(build_clip(tiny_cfg(), seed=0)).train()
    model.clip.encode_text, model.clip.encode_image = encode_text, encode_image
    samples = [(torch.full((3, 4, 4), float(i)), {"target": targets[i]}, captions[i]) for i in range(n)]
    result = zero_shot(model, tokenizer_fn, samples, "cpu")
    assert result == {"retrieval_top1": 0.8, "colour_acc": 0.4, "shape_acc": 0.6, "n": 10, "chance_retrieval": 0.1}
    assert model.training  # mode restored
    line = format_zero_shot(result)
    assert "\n" not in line and "0.800" in line and "0.400" in line and "0.600" in line


def test_class_prompts_cover_the_vocabulary():
    from data import shapes as S
    colour_prompts, shape_prompts = class_prompts()
    assert list(colour_prompts) == list(S.COLOURS) and list(shape_prompts) == list(S.SHAPES)
    assert "an orange star" in colour_prompts["orange"] and "three white crosses" in shape_prompts["cross"]
    assert all(len(p) == len(S.SHAPES) * 3 for p in colour_prompts.values())
