"""The vlm pipeline: token merge and tiling, packing that never changes the loss, frozen parts,
bad input counted and skipped, and the staged train -> eval / sample / export commands."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from common.config import ConfigError, build_config
from common.data.chat import train_bpe
from common.data.packing import IGNORE_INDEX
from pipelines.vlm.config import VLMConfig
from pipelines.vlm.data import PackCollate, VLMDecoder, image_tiles, tile_count, tile_grid
from pipelines.vlm.model import lm_loss, pixel_shuffle
from tests.conftest import ROOT, env, run_module

TINY = os.path.join(ROOT, "pipelines/vlm/configs/tiny.yaml")
SMALL = ["lm.dim=32", "lm.n_layers=2", "lm.n_heads=4", "lm.n_kv_heads=2", "clip.width=32", "clip.layers=1",
         "clip.heads=2", "clip.text_width=32", "clip.text_layers=1", "clip.text_heads=2", "clip.embed_dim=32"]


# --------------------------------------------------------------------------- token merge and tiles
def test_pixel_shuffle_merges_each_window_of_neighbouring_patches():
    grid, s, c = 4, 2, 3
    tokens = torch.arange(grid * grid * c, dtype=torch.float64).view(1, grid * grid, c)
    out = pixel_shuffle(tokens, grid, s)
    assert out.shape == (1, 4, s * s * c)
    # merged token (i, j) holds patches (2i + a, 2j + b) for a, b in {0, 1}, row-major within the window
    for i in range(2):
        for j in range(2):
            want = torch.cat([tokens[0, (2 * i + a) * grid + 2 * j + b] for a in range(2) for b in range(2)])
            assert torch.equal(out[0, i * 2 + j], want)
    with pytest.raises(ValueError, match="not a 3 x 3 grid"):
        pixel_shuffle(torch.zeros(1, 16, 1), 3, 2)


def test_tiles_thumbnail_then_grid_closest_to_the_aspect_ratio():
    assert tile_grid(48, 48, 48, 4) == (0, 0) and tile_count(40, 30, 48, 4) == 1
    assert tile_grid(96, 96, 48, 4) == (2, 2)
    assert tile_grid(144, 48, 48, 4) == (3, 1)
    assert tile_grid(500, 100, 48, 4) == (4, 1)          # capped at max_tiles
    assert tile_grid(96, 96, 48, 0) == (0, 0)            # thumbnail only
    img = Image.fromarray(np.tile(np.arange(96, dtype=np.uint8)[None, :, None], (96, 1, 3)))
    tiles = image_tiles(img, 48, 4)
    assert tiles.shape == (5, 3, 48, 48)
    # the grid tiles are the image's quarters: the left ones darker than the right ones
    assert tiles[1].mean() < tiles[2].mean() and tiles[3].mean() < tiles[4].mean()


# --------------------------------------------------------------------------- a tiny model
@pytest.fixture(scope="module")
def tok():
    texts = ["a red circle", "two blue squares", "What colour is the star?", "green", "Describe the image."] * 20
    return train_bpe(texts, 300)


def tiny_model(tok, dtype=torch.float64, seed=0):
    from common.nn.llama import Llama, LlamaConfig
    from pipelines.vlm.clip import ClipConfig, build_clip
    from pipelines.vlm.model import VisionLanguageModel
    ccfg = ClipConfig(image_size=16, patch_size=4, width=16, layers=1, heads=2, text_width=16, text_layers=1,
                      text_heads=2, embed_dim=16)
    visual = build_clip(ccfg, seed).visual
    torch.manual_seed(seed)
    lm = Llama(LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, multiple_of=16))
    model = VisionLanguageModel(visual, lm, vision_width=16, grid=4, shuffle=2, projector_hidden=24,
                                image_token_id=tok.image_token_id)
    return model.to(dtype)


def conversation(tok, n_tiles, answer, question="What colour is the star?"):
    g = torch.Generator().manual_seed(len(answer) * 7 + n_tiles)
    turns = [{"role": "user", "content": f"<image>\n{question}"}, {"role": "assistant", "content": answer}]
    enc = tok.encode_conversation(turns, [n_tiles * 4])
    return {"ids": torch.tensor(enc.ids), "loss_mask": torch.tensor(enc.loss_mask),
            "tiles": torch.randn(n_tiles, 3, 16, 16, generator=g)}


def forward_loss(model, batch, average):
    logits = model(batch["tokens"], batch["positions"], batch["tiles"].double(), batch["tile_mask"])
    return lm_loss(logits, torch.stack([batch["targets"], batch["positions"]], 1), average)


@pytest.mark.parametrize("average", ["token", "sample"])
def test_packed_equals_unpacked_losses_and_gradients(tok, average):
    """float64: the packed micro-batch's loss and every parameter gradient equal the same samples
    run one per row (no packing), to 1e-10."""
    samples = [conversation(tok, 1, "red"), conversation(tok, 2, "two blue squares and a star"),
               conversation(tok, 1, "green"), conversation(tok, 3, "a red circle")]
    model = tiny_model(tok)
    model.visual.requires_grad_(True)
    packed = PackCollate(64, tok.pad_id, packed=True)(samples)
    assert packed["tokens"].shape[0] < len(samples)  # really packed: several samples share a row
    loss_p = forward_loss(model, packed, average)
    grads_p = torch.autograd.grad(loss_p, list(model.parameters()), allow_unused=True)
    # reference: each sample alone, its own row; the same average over samples / tokens
    losses, counts = [], []
    for s in samples:
        one = PackCollate(64, tok.pad_id, packed=False)([s])
        losses.append(forward_loss(model, one, "token"))
        counts.append(int((one["targets"] != IGNORE_INDEX).sum()))
    if average == "token":
        ref = sum(l * c for l, c in zip(losses, counts)) / sum(counts)
    else:
        ref = sum(losses) / len(losses)
    grads_r = torch.autograd.grad(ref, list(model.parameters()), allow_unused=True)
    assert abs(float(loss_p.detach()) - float(ref.detach())) < 1e-10
    used = 0
    for (name, _), gp, gr in zip(model.named_parameters(), grads_p, grads_r):
        assert (gp is None) == (gr is None), name  # the pooled CLIP head (proj) is unused by the VLM
        if gp is not None:
            used += 1
            assert torch.allclose(gp, gr, rtol=0, atol=1e-10), name
    assert used > 20
    # and the image really matters: other tiles give another loss
    packed2 = dict(packed, tiles=packed["tiles"] + 1.0)
    assert abs(float(forward_loss(model, packed2, average).detach()) - float(loss_p.detach())) > 1e-6


def test_padding_tail_and_fixed_rows_leave_the_loss_alone(tok):
    samples = [conversation(tok, 1, "red"), conversation(tok, 1, "a red circle")]
    model = tiny_model(tok)
    free = PackCollate(64, tok.pad_id)(samples)
    fixed = PackCollate(64, tok.pad_id, rows=3, tiles_per_row=64 // 4)(samples)
    assert fixed["tokens"].shape[0] == 3 and fixed["tiles"].shape[1] == 16
    with torch.no_grad():
        assert abs(float(forward_loss(model, free, "sample")) - float(forward_loss(model, fixed, "sample"))) < 1e-12


# --------------------------------------------------------------------------- weight decay
def test_projector_position_table_is_not_decayed_but_its_weights_are(tok, tmp_path):
    from common.optim import build_optimizer
    from pipelines.vlm.components import build_vlm
    tok.save(str(tmp_path / "tok"))
    cfg = build_config(VLMConfig, TINY, [*SMALL, "stage.name=full", f"tokenizer.path={tmp_path / 'tok'}",
                                         "clip.image_size=16", "clip.patch_size=4", "stages=[]", "optim.weight_decay=0.1"])
    model = build_vlm(cfg, tok)
    opt = build_optimizer(model, cfg.optim)
    names = {id(p): n for n, p in model.named_parameters()}
    decay = {g["weight_decay"]: {names[id(p)] for p in g["params"]} for g in opt.param_groups}
    assert model.projector.pos.ndim == 2  # ndim alone would decay it
    assert "projector.pos" in decay[0.0] and "projector.pos" not in decay[0.1]
    assert {"projector.fc1.weight", "projector.fc2.weight"} <= decay[0.1]
    # open_clip's vision tower declares its position table the same way (timm's convention).
    assert "visual.positional_embedding" in decay[0.0] and model.visual.positional_embedding.ndim == 2
    # The opt-outs name only those tables: the rest of the model keeps the ndim rule.
    tables = {"projector.pos", "visual.positional_embedding"}
    assert decay[0.0] - tables == {n for n, p in model.named_parameters() if p.ndim < 2 and p.requires_grad}


# --------------------------------------------------------------------------- frozen parts
@pytest.mark.parametrize("stage,trainable", [("align", {"projector"}), ("instruct", {"projector", "lm"}),
                                             ("full", {"projector", "lm", "visual"})])
def test_frozen_parts_get_no_gradient_and_no_optimizer_state(tok, tmp_path, stage, trainable):
    from common.optim import build_optimizer
    from pipelines.vlm.components import build_vlm
    tok.save(str(tmp_path / "tok"))
    cfg = build_config(VLMConfig, TINY, [*SMALL, f"stage.name={stage}", f"tokenizer.path={tmp_path / 'tok'}",
                                         "clip.image_size=16", "clip.patch_size=4", "stages=[]"])
    model = build_vlm(cfg, tok)
    batch = PackCollate(64, tok.pad_id)([conversation(tok, 1, "red"), conversation(tok, 1, "green")])
    batch["tiles"] = batch["tiles"].float()
    logits = model(batch["tokens"], batch["positions"], batch["tiles"], batch["tile_mask"])
    lm_loss(logits, torch.stack([batch["targets"], batch["positions"]], 1)).backward()
    opt = build_optimizer(model, cfg.optim)
    opt.step()
    state = {id(p) for p in opt.state}
    for part in ("visual", "projector", "lm"):
        params = [p for n, p in getattr(model, part).named_parameters() if n != "proj"]  # CLIP's pooled head: unused
        assert not model.visual.proj.requires_grad
        if part in trainable:
            assert all(p.grad is not None for p in params), part
            assert all(id(p) in state for p in params), part
        else:
            assert all(p.grad is None for p in params), part   # nothing to all-reduce
            assert not any(id(p) in state for p in params), part


# --------------------------------------------------------------------------- bad input
def png(size=16) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


def sample(turns, image=True, key="k"):
    out = {"__key__": key, "json": json.dumps({"turns": turns}).encode()}
    if image:
        out["png"] = png()
    return out


GOOD = [{"role": "user", "content": "<image>\nWhat colour?"}, {"role": "assistant", "content": "red"}]


def test_decoder_rejects_bad_samples_with_one_line_reasons(tok):
    dec = VLMDecoder(tok, tile=16, max_tiles=2, tokens_per_tile=4, row_len=40)
    ok = dec(sample(GOOD))
    assert ok["tiles"].shape == (1, 3, 16, 16) and int((ok["ids"] == tok.image_token_id).sum()) == 4
    cases = {"no image": (sample(GOOD, image=False), "holds no image"),
             "no assistant": (sample(GOOD[:1]), "assistant"),
             "unknown role": (sample([{"role": "robot", "content": "<image>\nhi"}, GOOD[1]]), "role"),
             "too long": (sample([GOOD[0], {"role": "assistant", "content": "red " * 60}]), "longer than packing.row_len")}
    for name, (smp, msg) in cases.items():
        with pytest.raises(ValueError, match=msg):
            dec(smp)


def test_loader_counts_and_skips_bad_samples_and_keeps_going(tok, tmp_path):
    import webdataset as wds

    from common.data import StreamingLoader
    path = str(tmp_path / "shard-000000.tar")
    with wds.TarWriter(path) as w:
        for i in range(16):
            turns = GOOD if i % 4 else [GOOD[0]]           # every 4th: no assistant turn
            w.write(sample(turns, image=(i % 5 != 3), key=f"{i:04d}"))  # some images missing
    dec = VLMDecoder(tok, tile=16, max_tiles=2, tokens_per_tile=4, row_len=40)
    loader = StreamingLoader(path, dec, micro_batch_size=4, num_workers=0, collate=PackCollate(40, tok.pad_id))
    it = iter(loader)
    batches = [next(it) for _ in range(8)]  # two epochs
    corrupt = sum(b["__corrupt__"] for b in batches)
    bad = sum(1 for i in range(16) if i % 4 == 0 or i % 5 == 3)
    assert corrupt == 2 * bad
    assert all(len(b["__position__"]) == 4 for b in batches)
    assert all(int((b["tokens"] == tok.image_token_id).sum()) == 4 * int(b["tile_mask"].sum()) for b in batches)


def test_make_shards_conversations_decode_with_every_image(tok, tmp_path):
    """Shards from `data.make_shards conversations` (one image with a marker, two without) decode
    to one placeholder run per image, in order."""
    from data import make_shards
    d = tmp_path / "in"
    d.mkdir()
    for n, colour in {"a.png": (200, 10, 10), "b.png": (10, 10, 200)}.items():
        Image.new("RGB", (24, 24), colour).save(d / n)
    rows = [{"image": "a.png", "conversations": [{"from": "human", "value": "<image>\nWhat colour?"},
                                                 {"from": "gpt", "value": "red"}]},
            {"images": ["a.png", "b.png"], "turns": [{"role": "user", "content": "Compare."},
                                                      {"role": "assistant", "content": "red"}]}]
    (d / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "shards"
    assert make_shards.main(["conversations", "--input", str(d / "rows.jsonl"), "--out", str(out), "--size", "16",
                             "--format", "png"]) == 0
    from common.data.shards import iter_samples
    dec = VLMDecoder(tok, tile=16, max_tiles=2, tokens_per_tile=4, row_len=64)
    one, two = [dec(raw) for raw in iter_samples(str(out))]
    assert one["tiles"].shape[0] == 1 and two["tiles"].shape[0] == 2
    assert int((two["ids"] == tok.image_token_id).sum()) == 8
    # first image red, second blue, in placeholder order
    assert two["tiles"][0, 0].mean() > two["tiles"][0, 2].mean() and two["tiles"][1, 2].mean() > two["tiles"][1, 0].mean()


def test_lm_from_a_hugging_face_folder(tok, tmp_path):
    from common.nn.llama import Llama, LlamaConfig
    from common.nn.llama_hf import save_hf_lm
    from pipelines.vlm.components import build_lm
    torch.manual_seed(3)
    src = Llama(LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, multiple_of=16))
    save_hf_lm(src, tmp_path / "hf")
    cfg = build_config(VLMConfig, TINY, [f"lm.hf_path={tmp_path / 'hf'}", "stages=[]"])
    lm = build_lm(cfg, tok)
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), lm.state_dict().values()))
    small = Llama(LlamaConfig(dim=32, n_layers=1, n_heads=4, vocab_size=64, multiple_of=16))
    save_hf_lm(small, tmp_path / "small")
    with pytest.raises(ConfigError, match="embedding rows"):
        build_lm(build_config(VLMConfig, TINY, [f"lm.hf_path={tmp_path / 'small'}", "stages=[]"]), tok)


def test_config_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="stage.name"):
        build_config(VLMConfig, TINY, ["stage.name=pretrain"])
    with pytest.raises(ConfigError, match="packing.rows"):
        build_config(VLMConfig, TINY, ["parallel.pp=2"])
    with pytest.raises(ConfigError, match="pixel_shuffle=4 does not divide"):
        build_config(VLMConfig, TINY, ["model.pixel_shuffle=4"])
    with pytest.raises(ConfigError, match="each stage may appear once"):
        build_config(VLMConfig, TINY, ["stages=[{name: align}, {name: align}]"])


# --------------------------------------------------------------------------- the commands end to end
@pytest.mark.slow
def test_staged_train_then_eval_sample_export(vqa_data, tmp_path):
    run = str(tmp_path / "run")
    stages = "stages=[{name: clip, steps: 4, lr: 1.0e-3, micro_batch_size: 16}, {name: align, steps: 3, lr: 1.0e-3}, " \
             "{name: instruct, steps: 4, lr: 1.0e-3}]"
    proc = run_module("pipelines.vlm.train", "--config", TINY, f"run.dir={run}", f"data.train_shards={vqa_data}/train",
                      f"data.eval_shards={vqa_data}/heldout", stages, "data.micro_batch_size=8", "data.num_workers=0",
                      "train.progress=false", "sample.num=4", "tokenizer.vocab_size=400", *SMALL, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for stage in ("clip", "align", "instruct"):
        assert os.path.isdir(os.path.join(run, stage, "checkpoints", "step_00000004" if stage != "align" else "step_00000003"))
    assert os.path.isfile(os.path.join(run, "tokenizer", "tokenizer.json"))
    answers = [json.loads(line) for line in open(os.path.join(run, "instruct", "samples", "step_00000004.jsonl"))]
    assert len(answers) == 4 and {"question", "answer", "reference", "type"} <= answers[0].keys()
    # the align stage started from the clip stage's vision tower
    from common.run import load_run
    from pipelines.vlm.spec import SPEC
    clip, _ = load_run(SPEC, os.path.join(run, "clip"))
    align, _ = load_run(SPEC, os.path.join(run, "align"))
    for (n, a), b in zip(clip.model.visual.state_dict().items(), align.model.visual.state_dict().values()):
        assert torch.equal(a, b), n  # frozen in align: still the clip stage's weights

    ev = run_module("pipelines.vlm.eval", "--run", run, "--num", "8", "--captions", "2")
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert "colour" in ev.stdout and "clip stage" in ev.stdout
    result = json.load(open(os.path.join(run, "eval.json")))
    assert set(result["accuracy"]) <= {"colour", "shape", "count", "position"} and result["n_questions"] >= 8
    assert len(open(os.path.join(run, "eval_captions.jsonl")).readlines()) == 2

    img = tmp_path / "img.png"
    img.write_bytes(png(48))
    sm = run_module("pipelines.vlm.sample", "--run", run, "--image", str(img), "--prompt", "What colour is the square?",
                    "--out", str(tmp_path / "a.jsonl"))
    assert sm.returncode == 0, sm.stderr[-3000:]
    assert json.loads(open(tmp_path / "a.jsonl").read())["prompt"] == "What colour is the square?"
    bad = run_module("pipelines.vlm.sample", "--run", run, "--image", str(tmp_path / "missing.png"), "--prompt", "x")
    assert bad.returncode != 0 and "no such file" in bad.stderr and "Traceback" not in bad.stderr

    out = str(tmp_path / "export")
    ex = run_module("pipelines.vlm.export", "--run", run, "--out", out)
    assert ex.returncode == 0, ex.stderr[-3000:]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.nn.generate import greedy_generate
    comp, _ = load_run(SPEC, os.path.join(run, "instruct"))
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(out, "lm")).eval()
    hf_tok = AutoTokenizer.from_pretrained(os.path.join(out, "lm"))
    chat = [{"role": "user", "content": "What colour is the circle?"}]
    ids = hf_tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    assert ids == comp.tokenizer.encode_prompt(chat, [])
    x = torch.tensor([ids])
    with torch.no_grad():
        diff = (hf(x).logits - comp.model.lm(x)).abs().max()
    assert diff < 1e-4
    ours = greedy_generate(comp.model.lm, [x[0]], 6)[0]
    theirs = hf.generate(x, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert ours == theirs


@pytest.mark.slow
def test_a_signal_in_a_staged_run_saves_that_stage_and_starts_no_next_one(vqa_data, tmp_path):
    """SIGTERM in the clip stage's step 2 (train.save_on_signal): that stage saves step 2 and the
    command exits 143 without starting align; the same command then resumes clip from step 2 and
    runs the later stages."""
    run = str(tmp_path / "run")
    stages = "stages=[{name: clip, steps: 4, lr: 1.0e-3, micro_batch_size: 16}, {name: align, steps: 2, lr: 1.0e-3}]"
    cmd = [sys.executable, "-m", "pipelines.vlm.train", "--config", TINY, f"run.dir={run}",
           f"data.train_shards={vqa_data}/train", f"data.eval_shards={vqa_data}/heldout", stages,
           "data.micro_batch_size=8", "data.num_workers=0", "train.progress=false", "sample.num=0",
           "tokenizer.vocab_size=400", *SMALL]
    proc = subprocess.run(cmd, cwd=ROOT, env={**env(), "MMP_FAULT_SIGNAL_AT_STEP": "2"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 143, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert open(os.path.join(run, "clip", "checkpoints", "latest")).read().strip() == "step_00000002"
    assert "stage 2/2" not in proc.stdout and not os.path.exists(os.path.join(run, "align"))
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "at step 2" in proc.stdout, proc.stdout[-2000:]
    for stage, steps in (("clip", 4), ("align", 2)):
        latest = open(os.path.join(run, stage, "checkpoints", "latest")).read().strip()
        assert latest == f"step_{steps:08d}", (stage, latest)
