"""Where the planner's model comes from: a pipeline's config (its spec loaded by name, as
common/run.py's callers do; common imports no pipeline statically) or a named preset.

  DiT pipelines (text2image, text2video)  the model is built from the config on the meta device,
      so its sizes are the pipeline's own; a vae.path that is not on this machine is replaced by
      the geometry of an 8x, 4-channel AutoencoderKL (text2image's reference VAE), and said so.
  vlm                                     the Llama LM from the `lm` section (the vision tower is
      FSDP-only and left out of the plan)
  presets  dit-s / dit-b / dit-xl = text2image's xl.yaml with model.preset S / B / XL;
           llama-7b = Llama-2-7B sizes (4096 wide, 32 layers, 32 heads, SwiGLU 11008, vocab
           32000, 4096-token sequences), parallelized with the VLM's LM plan in the dry run.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import os
from dataclasses import dataclass

import torch

from common.config import ConfigError, build_config
from common.plan.models import ModelDesc, dit_desc, llama_desc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIT_PRESETS = {"dit-s": "S", "dit-b": "B", "dit-xl": "XL"}
LLAMA_7B = dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_hidden=11008, vocab_size=32000,
                max_seq_len=4096)
MODELS = tuple(DIT_PRESETS) + ("llama-7b",)


@dataclass
class Source:
    desc: ModelDesc
    spec: object = None        # the pipeline's SPEC (None for llama-7b)
    cfg: object = None         # its resolved config
    llama_cfg: object = None   # common.nn.llama.LlamaConfig for LM plans
    ema: bool = True
    default_batch: int = 0     # samples per GPU of the config's own layout (0: none)

    def build_model(self):
        """The full-size model on the meta device (what the dry run parallelizes)."""
        if self.llama_cfg is not None:
            from common.nn.llama import Llama
            with torch.device("meta"):
                return TextOnlyLM(Llama(self.llama_cfg))
        return _build_meta(self.spec, self.cfg)[0]


def load_spec(name: str):
    try:
        return importlib.import_module(f"pipelines.{name}.spec").SPEC
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith(f"pipelines.{name}"):
            known = sorted(d for d in os.listdir(os.path.join(ROOT, "pipelines"))
                           if os.path.isfile(os.path.join(ROOT, "pipelines", d, "spec.py")))
            raise ConfigError(f"--pipeline {name!r}: no pipelines/{name}/spec.py; "
                              f"choose from {', '.join(known)}") from None
        raise


def _build_meta(spec, cfg):
    cfg = dataclasses.replace(cfg)
    note = ""
    vae = getattr(cfg, "vae", None)
    latent = None
    if vae is not None and vae.path and not os.path.isdir(vae.path):
        m = cfg.model
        if spec.name == "text2image":
            s = m.image_size // 8
            latent = dict(img_size=s, in_channels=4)
            note = f"vae.path not found: assumed an 8x, 4-channel VAE ({s}x{s}x4 latents)"
        elif spec.name == "text2video" and getattr(vae, "kind", "") == "wan":
            latent = dict(frames=1 + (m.frames - 1) // 4, height=m.image_size // 8,
                          width=(m.image_width or m.image_size) // 8, in_channels=16)
            note = ("vae.path not found: assumed Wan 2.1's VAE (4x time, 8x space, 16 channels: "
                    f"{latent['frames']}x{latent['height']}x{latent['width']} latents)")
        else:
            raise ConfigError(f"vae.path={vae.path!r} is not on this machine and the {spec.name} latent geometry "
                              "depends on it; give a local VAE folder")
        cfg.vae = dataclasses.replace(vae, path="")
    with torch.device("meta"):
        model = spec.build(cfg).model
        if latent is not None:
            model = type(model)(dataclasses.replace(model.cfg, **latent))
    return model, note


def _dit_from_model(name: str, model, note: str) -> ModelDesc:
    mc = model.cfg
    w = model.patch_embed.proj.weight
    conv = tuple(w.shape[1:]) if w.dim() > 2 else None
    return dit_desc(name, hidden=mc.hidden, depth=mc.depth, heads=mc.heads, mlp_ratio=mc.mlp_ratio,
                    text_dim=mc.text_dim, text_len=mc.text_len, tokens=mc.num_tokens, patch_in=math.prod(w.shape[1:]),
                    out_dim=model.final.linear.out_features, patch_conv=conv, qk_norm=mc.qk_norm,
                    pooled_text=mc.pooled_text, note=note)


def resolve(pipeline: str | None, config: str | None, overrides=(), model: str | None = None) -> Source:
    if model is not None:
        if model == "llama-7b":
            from common.nn.llama import LlamaConfig
            lc = LlamaConfig(**LLAMA_7B)
            desc = llama_desc("llama-7b", dim=lc.dim, n_layers=lc.n_layers, n_heads=lc.n_heads, kv_heads=lc.kv_heads,
                              ffn=lc.ffn_dim, vocab=lc.vocab_size, seq_len=lc.max_seq_len,
                              note="Llama-2-7B sizes, 4096-token sequences, no vision tower")
            return Source(desc, llama_cfg=lc, ema=False)
        if model not in DIT_PRESETS:
            raise ConfigError(f"--model {model!r}: choose from {', '.join(MODELS)}")
        pipeline = "text2image"
        config = os.path.join(ROOT, "pipelines/text2image/configs/xl.yaml")
        overrides = [f"model.preset={DIT_PRESETS[model]}", *overrides]
    if not pipeline:
        raise ConfigError("give --model NAME, or --pipeline NAME (with --config FILE; without, the config's defaults)")
    spec = load_spec(pipeline)
    cfg = build_config(spec.config, config, list(overrides))
    ema = getattr(cfg.train, "ema_decay", 0) > 0
    per_gpu = cfg.data.micro_batch_size * cfg.train.grad_accum
    p = cfg.parallel
    per_gpu_share = p.tp * p.cp * p.pp
    if hasattr(cfg, "lm"):
        from common.nn.llama import LlamaConfig
        c = cfg.lm
        vocab = 64 * math.ceil(cfg.tokenizer.vocab_size / 64)
        lc = LlamaConfig(dim=c.dim, n_layers=c.n_layers, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, vocab_size=vocab,
                         ffn_hidden=c.ffn_hidden or None, multiple_of=64,
                         max_seq_len=max(c.max_seq_len, cfg.packing.row_len))
        desc = llama_desc(f"{pipeline} LM", dim=lc.dim, n_layers=lc.n_layers, n_heads=lc.n_heads, kv_heads=lc.kv_heads,
                          ffn=lc.ffn_dim, vocab=vocab, seq_len=cfg.packing.row_len,
                          note="the VLM's LM (packed rows of packing.row_len); vision tower not planned")
        return Source(desc, spec, cfg, llama_cfg=lc, ema=ema, default_batch=per_gpu / per_gpu_share)
    meta, note = _build_meta(spec, cfg)
    if not hasattr(meta, "blocks") or not hasattr(meta.cfg, "num_tokens"):
        raise ConfigError(f"--pipeline {pipeline}: the planner knows the DiT family and the Llama LM; "
                          f"{type(meta).__name__} is neither")
    if getattr(meta.cfg, "attention", "full") != "full":
        raise ConfigError(f"model.attention={meta.cfg.attention}: the planner prices full attention only")
    desc = _dit_from_model(f"{pipeline} {getattr(cfg.model, 'preset', '')}".strip(), meta, note)
    real = sum(p.numel() for p in meta.parameters())
    if real != desc.num_params:  # a family member with parameters the DiT trunk's table does not know
        raise ConfigError(f"--pipeline {pipeline}: the model has {real:,} parameters, the planner's DiT table "
                          f"{desc.num_params:,}; its parameter table needs extending (common/plan/models.py)")
    return Source(desc, spec, cfg, ema=ema, default_batch=per_gpu / per_gpu_share)


class TextOnlyLM(torch.nn.Module):
    """A Llama as the VLM's LM plan (common/nn/vlm_parallel.py) sees a vision-language model whose
    vision tower and projector hold no parameters: the dry run parallelizes a bare LM exactly
    as the VLM's LM is parallelized in training."""
    EMBED_MODULES = ("visual", "projector")

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.visual = torch.nn.Module()
        self.projector = torch.nn.Module()
        self.vision_dispatch = lambda fn, tiles: fn(tiles)

    def embed(self, tokens, tiles=None, tile_mask=None):
        return self.lm.tok_embeddings(tokens)
