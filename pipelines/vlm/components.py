"""Builds the pieces of a vlm run from its config: the stage's model (CLIP, or vision tower +
projector + Llama with the stage's frozen parts), tokenizer, decoder and collate, step functions,
the previous stage's weights, and the answers written during training. spec.py hands them to the
shared entrypoints."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from common.config import ConfigError, from_yaml_file
from common.data.chat import ChatTokenizer
from common.data.images import image_bytes
from common.data.shards import iter_samples
from common.diffusion.noise import mix_seed
from common.nn.llama import Llama, LlamaConfig
from pipelines.vlm import clip as clip_stage
from pipelines.vlm.config import VLMConfig
from pipelines.vlm.data import PackCollate, VLMDecoder
from pipelines.vlm.model import VisionLanguageModel, lm_loss

PIPELINE = "vlm"
VOCAB_MULTIPLE = 64  # embedding rows rounded up so that any tensor-parallel degree up to 64 divides them


@dataclass
class Components:
    cfg: VLMConfig
    model: nn.Module
    tokenizer: ChatTokenizer | None = None
    frozen: dict = field(default_factory=dict)

    @property
    def is_clip(self) -> bool:
        return self.cfg.stage.name == "clip"

    def to(self, device) -> None:
        self.model.to(device)


# --------------------------------------------------------------------------- tokenizer
def resolve_tokenizer(cfg: VLMConfig, is_main: bool = True) -> ChatTokenizer:
    """tokenizer.path, else the LM's folder (lm.hf_path), else RUN/tokenizer: loaded when it exists,
    otherwise trained on data.train_shards (deterministic, so every rank trains the same one; the
    main rank writes it) and tokenizer.path set to it, so config.yaml records where it is."""
    if cfg.tokenizer.path:
        return ChatTokenizer.load(cfg.tokenizer.path)
    if cfg.lm.hf_path:
        return ChatTokenizer.load(cfg.lm.hf_path)
    target = os.path.join(cfg.run.dir, "tokenizer")
    if os.path.isfile(os.path.join(target, "tokenizer.json")):
        tok = ChatTokenizer.load(target)
    else:
        from data.tokenizer import train_from_shards
        tok = train_from_shards([cfg.data.train_shards], cfg.tokenizer.vocab_size)
        if is_main:
            tmp = f"{target}.tmp{os.getpid()}"
            tok.save(tmp)
            os.replace(tmp, target)
    cfg.tokenizer.path = target
    return tok


# --------------------------------------------------------------------------- model
def _lm_config(cfg: VLMConfig, vocab: int) -> LlamaConfig:
    c = cfg.lm
    return LlamaConfig(dim=c.dim, n_layers=c.n_layers, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads,
                       vocab_size=vocab, ffn_hidden=c.ffn_hidden or None, multiple_of=64,
                       max_seq_len=c.max_seq_len, rope_theta=c.rope_theta)


def build_lm(cfg: VLMConfig, tokenizer: ChatTokenizer) -> Llama:
    vocab = VOCAB_MULTIPLE * math.ceil(tokenizer.vocab_size / VOCAB_MULTIPLE)
    if cfg.lm.backend != "native":
        raise ConfigError("lm.backend=megatron needs CUDA and megatron-core; this build trains the native LM "
                          "(common/nn/llama_megatron.py converts weights both ways)")
    if cfg.lm.hf_path:
        from common.nn.llama_hf import load_hf_lm
        lm = load_hf_lm(cfg.lm.hf_path)
        if lm.cfg.vocab_size < tokenizer.vocab_size:
            raise ConfigError(f"lm.hf_path: the LM has {lm.cfg.vocab_size} embedding rows but the tokenizer "
                              f"(with the chat special tokens) needs {tokenizer.vocab_size}")
        return lm
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(mix_seed(cfg.run.seed, 301))
        return Llama(_lm_config(cfg, vocab))


def build_vlm(cfg: VLMConfig, tokenizer: ChatTokenizer) -> VisionLanguageModel:
    visual = clip_stage.build_clip(cfg.clip, mix_seed(cfg.run.seed, 300)).visual
    lm = build_lm(cfg, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(mix_seed(cfg.run.seed, 302))
        model = VisionLanguageModel(visual, lm, vision_width=cfg.clip.width, grid=cfg.clip.image_size // cfg.clip.patch_size,
                                    shuffle=cfg.model.pixel_shuffle, projector_hidden=cfg.model.projector_hidden,
                                    image_token_id=tokenizer.image_token_id)
    trainable = {"align": ("projector",), "instruct": ("projector", "lm"), "full": ("projector", "lm", "visual")}
    for name in ("visual", "projector", "lm"):
        getattr(model, name).requires_grad_(name in trainable[cfg.stage.name])
    if isinstance(getattr(model.visual, "proj", None), nn.Parameter):
        # CLIP's pooled-feature projection: the VLM reads patch tokens, so it never gets a gradient
        # (and must not be a trainable parameter without one under data parallelism).
        model.visual.proj.requires_grad_(False)
    return model


def build(cfg: VLMConfig) -> Components:
    if cfg.stage.name == "clip":
        clip = clip_stage.build_clip(cfg.clip, mix_seed(cfg.run.seed, 300))
        return Components(cfg, clip_stage.ClipTrainModel(clip))
    tok = resolve_tokenizer(cfg, int(os.environ.get("RANK", "0")) == 0)
    return Components(cfg, build_vlm(cfg, tok), tok)


def init_from_previous(comp: Components) -> None:
    """stage.init: a clip run gives the vision tower, a VLM run the whole model (its EMA weights
    when it kept them). Runs before a resume, which then overrides everything."""
    prev = comp.cfg.stage.init
    if not prev:
        return
    from common.checkpoint import CheckpointError
    from common.run import check_run_dir, load_run
    from pipelines.vlm.spec import SPEC
    try:
        prev_cfg = from_yaml_file(VLMConfig, check_run_dir(prev))
    except CheckpointError as e:
        raise ConfigError(f"stage.init: {e}") from None
    prev_comp, _ = load_run(SPEC, prev)
    if prev_cfg.stage.name == "clip":
        if comp.is_clip:
            comp.model.load_state_dict(prev_comp.model.state_dict())
        else:
            comp.model.visual.load_state_dict(prev_comp.model.visual.state_dict())
    elif comp.is_clip:
        raise ConfigError(f"stage.init={prev} is a {prev_cfg.stage.name} run; a clip stage starts from a clip run")
    else:
        comp.model.load_state_dict(prev_comp.model.state_dict())


# --------------------------------------------------------------------------- data and steps
def tokens_per_tile(cfg: VLMConfig) -> int:
    return (cfg.clip.image_size // cfg.clip.patch_size // cfg.model.pixel_shuffle) ** 2


def decoder(comp: Components):
    cfg = comp.cfg
    if comp.is_clip:
        return clip_stage.ClipDecoder(cfg.clip)
    return VLMDecoder(comp.tokenizer, tile=cfg.clip.image_size, max_tiles=cfg.model.max_tiles,
                      tokens_per_tile=tokens_per_tile(cfg), row_len=cfg.packing.row_len,
                      task="caption" if cfg.stage.name == "align" else "chat", caption_prompt=cfg.stage.caption_prompt)


def collate(comp: Components):
    if comp.is_clip:
        return None
    p = comp.cfg.packing
    return PackCollate(p.row_len, comp.tokenizer.pad_id, packed=p.enabled, rows=p.rows,
                       tiles_per_row=p.row_len // tokens_per_tile(comp.cfg) if p.rows else 0)


def step_fns(comp: Components, device):
    if comp.is_clip:
        return clip_stage.clip_step_fns(comp.model, device)
    average = comp.cfg.packing.loss_average

    def prepare(batch: dict):
        inputs = tuple(batch[k].to(device) for k in ("tokens", "positions", "tiles", "tile_mask"))
        target = torch.stack([batch["targets"], batch["positions"]], 1).to(device)
        return inputs, target

    return prepare, lambda logits, target: lm_loss(logits, target, average)


def parallelize(model, pcfg, info, **kw):
    if isinstance(model, clip_stage.ClipTrainModel):
        from common.parallel.parallel_model import parallelize_data_only
        units = list(getattr(model.clip.visual.transformer, "resblocks", [])) + \
            list(getattr(getattr(model.clip, "transformer", None), "resblocks", []))
        return parallelize_data_only(model, pcfg, info, units=units, **kw)
    from common.nn.vlm_parallel import parallelize_vlm
    return parallelize_vlm(model, pcfg, info, **kw)


def signature(comp: Components) -> dict:
    cfg = comp.cfg
    clip = {k: v for k, v in dataclasses.asdict(cfg.clip).items() if k != "weights"}
    if comp.is_clip:
        return {"pipeline": PIPELINE, "kind": "clip", "clip": clip}
    return {"pipeline": PIPELINE, "kind": "vlm", "clip": clip, "lm": dataclasses.asdict(comp.model.lm.cfg),
            "model": dataclasses.asdict(cfg.model), "vocab": comp.tokenizer.vocab_size}


def flops(comp: Components, inputs: tuple) -> float:
    """Forward FLOPs of a micro-batch: 2 x parameters x tokens for the LM's and the ViT's matmuls
    plus causal attention over each packed segment; clip: 2 x parameters per image/caption."""
    if comp.is_clip:
        n = sum(p.numel() for p in comp.model.parameters())
        return 2.0 * n * len(inputs[0])
    model = comp.model
    lm, c = model.lm, model.lm.cfg
    tokens, positions, tiles, tile_mask = inputs
    dense = sum(p.numel() for p in lm.parameters()) - lm.tok_embeddings.weight.numel()
    from common.data.packing import segments_from_positions
    cu, _ = segments_from_positions(positions)
    seg = (cu[1:] - cu[:-1]).double()
    attn = 2.0 * c.n_layers * c.dim * float((seg * seg).sum())  # QK^T and AV, causal half of 2 x 2
    n_tiles = int(tile_mask.sum())
    vit = sum(p.numel() for p in model.visual.parameters()) + sum(p.numel() for p in model.projector.parameters())
    patches = (comp.cfg.clip.image_size // comp.cfg.clip.patch_size) ** 2 + 1
    return 2.0 * dense * tokens.numel() + attn + 2.0 * vit * patches * n_tiles


def describe(comp: Components) -> str:
    if comp.is_clip:
        return f"stage clip: open_clip {clip_stage.clip_model_name(comp.cfg.clip)}"
    m = comp.model
    frozen = [n for n in ("visual", "projector", "lm") if not any(p.requires_grad for p in getattr(m, n).parameters())]
    return (f"stage {comp.cfg.stage.name}: ViT -> pixel shuffle {comp.cfg.model.pixel_shuffle} -> projector -> "
            f"Llama ({m.lm.cfg.n_layers} layers, dim {m.lm.cfg.dim}, vocab {m.lm.cfg.vocab_size}), "
            f"{m.tokens_per_tile} tokens/tile, frozen: {', '.join(frozen) or 'none'}")


# --------------------------------------------------------------------------- answers
def heldout_questions(shards: str, n: int) -> list[tuple[bytes, str, str, str]]:
    """(image bytes, question, answer, type) of the first held-out samples' qa items, up to n."""
    out = []
    for raw in iter_samples(shards):
        meta = json.loads(raw["json"])
        img = image_bytes(raw)
        for qa in meta.get("qa", []):
            out.append((img, qa["question"], qa["answer"], qa["type"]))
            if len(out) >= n:
                return out
    return out


def answer(comp: Components, model: VisionLanguageModel, images: list, questions: list[str], *,
           max_new_tokens: int, device=torch.device("cpu"), batch_size: int = 64) -> list[str]:
    """Greedy answers to `questions`, each about its image (bytes or PIL image; None: no image)."""
    import io

    from PIL import Image

    from common.nn.generate import greedy_generate
    from pipelines.vlm.data import image_tiles
    cfg, tok = comp.cfg, comp.tokenizer
    was_training = model.training
    model.eval()
    out = []
    try:
        for start in range(0, len(questions), batch_size):
            prompts = []
            for img, q in zip(images[start:start + batch_size], questions[start:start + batch_size]):
                if img is None:
                    ids = tok.encode_prompt([{"role": "user", "content": q}], [])
                    prompts.append(model.lm.tok_embeddings(torch.tensor(ids, device=device)))
                    continue
                pil = Image.open(io.BytesIO(img)) if isinstance(img, bytes) else img
                tiles = image_tiles(pil, cfg.clip.image_size, cfg.model.max_tiles).to(device)
                content = q if "<image>" in q else "<image>\n" + q
                ids = torch.tensor(tok.encode_prompt([{"role": "user", "content": content}],
                                                     [len(tiles) * model.tokens_per_tile]), device=device)
                with torch.no_grad():
                    h = model.embed(ids[None], tiles[None], torch.ones(1, len(tiles), dtype=torch.bool, device=device))
                prompts.append(h[0])
            new = greedy_generate(model.lm, prompts, max_new_tokens, stop_ids=[tok.end_id])
            out += [tok.decode([t for t in ids if t != tok.end_id]).strip() for ids in new]
    finally:
        model.train(was_training)
    return out


def sample_hook(comp: Components, model, step: int, info) -> None:
    """At each sample point: the first sample.num held-out questions answered, written to
    samples/step_N.jsonl (clip: zero-shot accuracy to samples/step_N.json). Every rank runs it
    (sharded models need every rank in their collectives); the main rank writes."""
    cfg = comp.cfg
    if not cfg.data.eval_shards or not cfg.sample.num:
        return
    stem = os.path.join(cfg.run.dir, "samples", f"step_{step:08d}")
    device = info.device
    if comp.is_clip:
        from torch.distributed.tensor import DTensor
        if any(isinstance(p, DTensor) for p in model.parameters()):
            return  # FSDP-sharded CLIP: encode_image bypasses the root's unshard; eval.py reports zero-shot
        result = clip_zero_shot(comp, model, cfg.data.eval_shards, max(cfg.sample.num, 64), device)
        if info.is_main:
            os.makedirs(os.path.dirname(stem), exist_ok=True)
            with open(stem + ".json", "w") as f:
                json.dump(result, f)
            print(f"step {step}: zero-shot {clip_stage.format_zero_shot(result)}", flush=True)
        return
    qs = heldout_questions(cfg.data.eval_shards, cfg.sample.num)
    answers = answer(comp, model, [q[0] for q in qs], [q[1] for q in qs], max_new_tokens=cfg.sample.max_new_tokens,
                     device=device)
    if not info.is_main:
        return
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    with open(stem + ".jsonl", "w") as f:
        for (_, q, ref, kind), a in zip(qs, answers):
            f.write(json.dumps({"type": kind, "question": q, "answer": a, "reference": ref}) + "\n")


def clip_zero_shot(comp: Components, model, shards: str, n: int, device) -> dict:
    dec = clip_stage.ClipDecoder(comp.cfg.clip)
    samples = []
    for raw in iter_samples(shards):
        out = dec(raw)
        samples.append((out["image"], json.loads(raw["json"]), raw["txt"].decode("utf-8").strip()))
        if len(samples) >= n:
            break
    return clip_stage.zero_shot(model, dec.tokenize, samples, device)
