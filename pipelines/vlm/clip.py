"""Stage 0 of the vision-language pipeline: CLIP contrastive pretraining with open_clip.

The model is open_clip's own `CLIP` (ViT image tower, causal text transformer), built by
`open_clip.create_model` from a model config that `ClipConfig` describes and that is registered in
open_clip's config registry under a name derived from it (`clip_model_name`). The loss is
open_clip's `ClipLoss`; the tokenizer is open_clip's tokenizer for that name (the BPE
`SimpleTokenizer` with its vocabulary bundled in the package, so nothing touches the network).
The trained vision tower then feeds the later stages through `vision_tokens` (ViT -> pixel
shuffle -> projector -> LM).

Data parallelism. Every rank computes the loss over the *global* batch: `ClipLoss` all-gathers
the normalised features of all ranks with gradient (`gather_with_grad=True`) and builds the full
(B x B) logits on each rank (`local_loss=False`). Each rank's loss then equals the single-process
loss of the global batch, and the backward of the differentiable all-gather sums the gradients of
the W identical losses into each rank's local features: rank r's parameter gradient is W times
the part of dL/dtheta that flows through its own samples, so the mean over ranks that DDP and
FSDP take is exactly dL/dtheta. The process group is the default one: run this stage data
parallel only (world size = data-parallel degree).

Zero-shot evaluation (`zero_shot`) on held-out synthetic samples:
  * retrieval: each image ranks the N captions of the evaluated set (its own among them);
    top-1 counts as correct when the best caption's text equals the image's caption (identical
    captions of different images are indistinguishable, so neither is penalised).
  * colour / shape of the image's target kind (json "target" = [colour, shape, count]): one
    class embedding per colour (per shape) from a prompt ensemble, as in the CLIP paper. The
    prompts use the captions' own phrasing, since the synthetic captions never say "shape" or
    "object": a colour's prompts are "a {colour} {shape}", "two {colour} {shapes}" and
    "three {colour} {shapes}" for every shape (the other attribute and the count marginalised),
    a shape's prompts the same for every colour. Prompt embeddings are normalised, averaged and
    renormalised per class. Chance is 1/8 for colour and 1/6 for shape; images with a distractor
    of another colour (shape) make 100% unreachable by design.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from common.config import ConfigError, doc

# open_clip 3.3's gather_features calls torch.distributed.nn.all_gather, which torch 2.14 marks
# deprecated with a FutureWarning on every rank; the call is correct (its backward sums the
# gradients of all ranks, which the identity in the module docstring relies on).
warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_gather is deprecated",
                        category=FutureWarning)

VOCAB_SIZE = 49408  # open_clip's SimpleTokenizer (bundled BPE vocabulary)
LOGIT_SCALE_MAX = math.log(100.0)  # open_clip's training loop clamps logit_scale to [0, ln 100]


# --------------------------------------------------------------------------- config
@dataclass
class ClipConfig:
    image_size: int = doc(48, "input resolution (square); images of another size are resized to it")
    patch_size: int = doc(8, "ViT patch size in pixels (image_size must be a multiple)")
    width: int = doc(128, "ViT width")
    layers: int = doc(4, "ViT blocks")
    heads: int = doc(4, "ViT attention heads (head width = width / heads)")
    mlp_ratio: float = doc(4.0, "MLP hidden / width, both towers")
    text_width: int = doc(128, "text transformer width")
    text_layers: int = doc(2, "text transformer blocks")
    text_heads: int = doc(4, "text transformer attention heads")
    context_length: int = doc(32, "caption tokens incl. start/end (longer captions are truncated)")
    embed_dim: int = doc(128, "shared image-text embedding size")
    init_logit_scale: float = doc(math.log(1 / 0.07), "initial log of the logit scale (CLIP: ln(1/0.07))")
    weights: str = doc("", "local open_clip checkpoint file of this architecture to start from "
                           "(empty: random init from the seed)")

    def validate(self, prefix: str = "clip") -> None:
        """ConfigError naming the first inconsistent field (`prefix.field=value`)."""
        positive = ("image_size", "patch_size", "width", "layers", "heads", "mlp_ratio", "text_width",
                    "text_layers", "text_heads", "context_length", "embed_dim")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{prefix}.{name}={getattr(self, name)} must be > 0")
        if self.image_size % self.patch_size:
            raise ConfigError(f"{prefix}.image_size={self.image_size} must be a multiple of "
                              f"{prefix}.patch_size={self.patch_size}")
        if self.width % self.heads:
            raise ConfigError(f"{prefix}.width={self.width} must be divisible by {prefix}.heads={self.heads}")
        if self.text_width % self.text_heads:
            raise ConfigError(f"{prefix}.text_width={self.text_width} must be divisible by "
                              f"{prefix}.text_heads={self.text_heads}")
        if self.context_length < 3:
            raise ConfigError(f"{prefix}.context_length={self.context_length} must be >= 3 "
                              "(start and end tokens plus at least one word)")
        if not math.isfinite(self.init_logit_scale) or not 0.0 <= self.init_logit_scale <= LOGIT_SCALE_MAX:
            raise ConfigError(f"{prefix}.init_logit_scale={self.init_logit_scale} must be in "
                              f"[0, ln 100 = {LOGIT_SCALE_MAX:.3f}]")
        if self.weights and not os.path.isfile(self.weights):
            raise ConfigError(f"{prefix}.weights={self.weights!r} is not a file")


def clip_model_config(cfg: ClipConfig) -> dict:
    """The open_clip model config (the JSON layout of open_clip/model_configs/*.json)."""
    return {
        "embed_dim": cfg.embed_dim,
        "init_logit_scale": float(cfg.init_logit_scale),
        "vision_cfg": {"image_size": cfg.image_size, "patch_size": cfg.patch_size, "width": cfg.width,
                       "layers": cfg.layers, "head_width": cfg.width // cfg.heads, "mlp_ratio": cfg.mlp_ratio},
        "text_cfg": {"context_length": cfg.context_length, "vocab_size": VOCAB_SIZE, "width": cfg.text_width,
                     "heads": cfg.text_heads, "layers": cfg.text_layers, "mlp_ratio": cfg.mlp_ratio},
    }


def clip_model_name(cfg: ClipConfig) -> str:
    """A readable name plus a digest of the whole model config: equal names, equal architectures."""
    mc = clip_model_config(cfg)
    digest = hashlib.sha1(json.dumps(mc, sort_keys=True).encode()).hexdigest()[:10]
    return (f"vlm-clip-vit-i{cfg.image_size}-p{cfg.patch_size}-w{cfg.width}-l{cfg.layers}"
            f"-t{cfg.text_width}x{cfg.text_layers}-e{cfg.embed_dim}-{digest}")


def register_clip_config(cfg: ClipConfig) -> str:
    """Register the model config in open_clip's registry (idempotent, per process); -> its name.

    open_clip 3.3 registers architectures only from JSON files (`add_model_config(path)`, which
    rescans every registered path): the config is written to a temporary file, registered, and the
    file removed (the registry keeps the parsed config; a rescan skips the vanished path).
    """
    import open_clip
    name = clip_model_name(cfg)
    if name in open_clip.list_models():
        return name
    with tempfile.TemporaryDirectory(prefix="vlm_clip_cfg_") as tmp:
        path = os.path.join(tmp, name + ".json")
        with open(path, "w") as f:
            json.dump(clip_model_config(cfg), f)
        open_clip.add_model_config(path)
    if name not in open_clip.list_models():
        raise RuntimeError(f"open_clip did not register the model config {name}")
    return name


@contextlib.contextmanager
def _quiet_logging(level: int):
    """Silence log records up to `level` (open_clip's create_model warns on a random init)."""
    previous = logging.root.manager.disable
    logging.disable(max(level, previous))
    try:
        yield
    finally:
        logging.disable(previous)


def build_clip(cfg: ClipConfig, seed: int) -> nn.Module:
    """open_clip CLIP for `cfg`, initialised from `seed` apart from the global RNG (left untouched),
    so every rank and every rebuild gets identical weights; then `cfg.weights` loaded if set
    (strictly: every key must match this architecture)."""
    import open_clip
    name = register_clip_config(cfg)
    with torch.random.fork_rng(devices=[]), _quiet_logging(logging.WARNING if not cfg.weights else logging.NOTSET):
        torch.manual_seed(seed)
        return open_clip.create_model(name, pretrained=cfg.weights or None, precision="fp32", device="cpu")


def build_tokenizer(cfg: ClipConfig) -> Callable[[Sequence[str]], torch.Tensor]:
    """open_clip's tokenizer for the registered model: list of str -> int64 (B, context_length)."""
    import open_clip
    return open_clip.get_tokenizer(register_clip_config(cfg), context_length=cfg.context_length)


def preprocess_stats(cfg: ClipConfig) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(mean, std) per RGB channel that open_clip attaches to the model built for `cfg`
    (`open_clip.get_model_preprocess_cfg(model)`): PreprocessCfg's defaults, the OpenAI CLIP
    statistics, since create_model only changes them for a named pretrained tag."""
    from open_clip.transform import PreprocessCfg
    pc = PreprocessCfg()
    return tuple(pc.mean), tuple(pc.std)


# --------------------------------------------------------------------------- data
class ClipDecoder:
    """Picklable loader decoder: sample bytes -> {"image": float (3, S, S) normalised with the
    model's mean/std, "text": int64 (context_length,) token ids}.

    Reads png/jpg/jpeg/webp (scaled to cover image_size and centre-cropped when the size
    differs, bicubic, as open_clip's 'shortest' resize mode does). A missing image or caption
    raises ValueError: the loader counts the sample as corrupt and skips it. The tokenizer is
    built lazily in each process and never pickled (workers receive only the config).
    """

    def __init__(self, cfg: ClipConfig):
        from common.data.images import ImageDecoder
        self.cfg = cfg
        self._images = ImageDecoder(cfg.image_size)  # -> [-1, 1] image and the stripped caption
        mean, std = preprocess_stats(cfg)
        self._mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        self._std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
        self._tokenizer = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_tokenizer"] = None
        return state

    def tokenize(self, texts: Sequence[str]) -> torch.Tensor:
        if self._tokenizer is None:
            self._tokenizer = build_tokenizer(self.cfg)
        return self._tokenizer(list(texts))

    def __call__(self, sample: dict) -> dict:
        out = self._images(sample)  # ValueError without a caption or an image
        if not out["caption"]:
            raise ValueError("sample has an empty txt caption")
        image = (out["image"] + 1.0) * 0.5  # [0, 1], as open_clip's ToTensor gives
        return {"image": (image - self._mean) / self._std,
                "text": self.tokenize([out["caption"]])[0].to(torch.int64)}


# --------------------------------------------------------------------------- model and loss
class ClipTrainModel(nn.Module):
    """The trainable module handed to the parallel wrapper and the trainer.

    forward(image, text) -> (image_features, text_features, logit_scale): L2-normalised features
    and exp(logit_scale), as open_clip's CLIP.forward returns them. open_clip's own training loop
    clamps the logit_scale parameter to [0, ln 100] after every optimizer step; the shared trainer
    has no post-step hook, so the value is clamped here instead (the same logits while under 100).
    """

    def __init__(self, clip: nn.Module):
        super().__init__()
        self.clip = clip

    @property
    def visual(self) -> nn.Module:
        return self.clip.visual

    def forward(self, image: torch.Tensor, text: torch.Tensor):
        image_features = self.clip.encode_image(image, normalize=True)
        text_features = self.clip.encode_text(text, normalize=True)
        logit_scale = self.clip.logit_scale.clamp(0.0, LOGIT_SCALE_MAX).exp()
        return image_features, text_features, logit_scale


def _dp_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def clip_criterion(out: tuple, _target: Any = None) -> torch.Tensor:
    """open_clip ClipLoss over the global batch (see the module docstring for why the gradients
    averaged over ranks equal the single-process ones)."""
    from open_clip import ClipLoss
    rank, world = _dp_rank_world()
    loss = ClipLoss(local_loss=False, gather_with_grad=True, rank=rank, world_size=world)
    image_features, text_features, logit_scale = out[:3]
    return loss(image_features, text_features, logit_scale)


def clip_step_fns(model: nn.Module, device: torch.device | str):
    """(prepare, criterion) for common.trainer: prepare(batch) -> ((image, text), None) on
    `device`; criterion(model(image, text), None) -> loss. No per-sample randomness: CLIP needs
    none (augmentation, if ever wanted, belongs in the decoder)."""
    device = torch.device(device)

    def prepare(batch: dict):
        image = batch["image"].to(device, non_blocking=True)
        text = batch["text"].to(device, non_blocking=True)
        return (image, text), None

    return prepare, clip_criterion


# --------------------------------------------------------------------------- vision tokens
def vision_tokens(visual: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The ViT's patch tokens for the VLM stages: (N, num_patches, width), taken after the last
    block and the final LayerNorm (ln_post), without the class token and before the projection.

    open_clip's VisionTransformer returns (pooled, tokens) from its forward when `output_tokens`
    is set: tokens = ln_post(x)[:, 1:] for the default class-token pooling, the same tensor
    `forward_intermediates(indices=1, normalize_intermediates=True, intermediates_only=True,
    output_fmt="NLC")` yields. Going through forward (module __call__) rather than
    forward_intermediates keeps FSDP's pre-forward unshard hooks of the tower's root in the path.
    The flag is set for the call only, so the CLIP image path (pooled features) is unchanged.
    """
    if getattr(visual, "attn_pool", None) is not None or getattr(visual, "pool_type", "tok") != "tok":
        raise ValueError("vision_tokens expects open_clip's default class-token ViT "
                         f"(pool_type={getattr(visual, 'pool_type', None)!r}, attentional pool: "
                         f"{getattr(visual, 'attn_pool', None) is not None})")
    previous = visual.output_tokens
    visual.output_tokens = True
    try:
        _, tokens = visual(images)
    finally:
        visual.output_tokens = previous
    return tokens


# --------------------------------------------------------------------------- zero-shot eval
_NUMBER_WORDS = {1: "a", 2: "two", 3: "three"}


def class_prompts() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """({colour: prompts}, {shape: prompts}): each class's prompts in the captions' phrasing, the
    other attribute and the count (1-3) marginalised (see the module docstring)."""
    from data import shapes as S
    from data.synth_vqa import plural

    def phrase(colour: str, shape: str, n: int) -> str:
        if n == 1:  # "a"/"an" as the captions write it
            from data.synth_common import article
            return f"{article(colour)} {shape}"
        return f"{_NUMBER_WORDS[n]} {colour} {plural(shape)}"

    counts = (1, 2, 3)
    colours = {c: [phrase(c, s, n) for s in S.SHAPES for n in counts] for c in S.COLOURS}
    shapes = {s: [phrase(c, s, n) for c in S.COLOURS for n in counts] for s in S.SHAPES}
    return colours, shapes


def _unwrap_clip(model: nn.Module) -> nn.Module:
    return getattr(model, "clip", model)


@torch.no_grad()
def _encode_texts(clip: nn.Module, tokenizer_fn, texts: list[str], device, chunk: int = 256) -> torch.Tensor:
    parts = [clip.encode_text(tokenizer_fn(texts[i:i + chunk]).to(device), normalize=True).float()
             for i in range(0, len(texts), chunk)]
    return torch.cat(parts)


@torch.no_grad()
def _class_embeddings(clip, tokenizer_fn, prompts: dict[str, list[str]], device) -> tuple[list[str], torch.Tensor]:
    names = list(prompts)
    flat = [p for n in names for p in prompts[n]]
    emb = _encode_texts(clip, tokenizer_fn, flat, device)
    out, start = [], 0
    for n in names:
        k = len(prompts[n])
        out.append(F.normalize(emb[start:start + k].mean(0), dim=-1))
        start += k
    return names, torch.stack(out)


@torch.no_grad()
def zero_shot(model: nn.Module, tokenizer_fn: Callable[[Sequence[str]], torch.Tensor],
              samples: Sequence[tuple[torch.Tensor, dict, str]], device: torch.device | str,
              batch_size: int = 256) -> dict:
    """Zero-shot accuracies of a CLIP (open_clip CLIP or ClipTrainModel) on held-out samples
    [(image (3, S, S) as ClipDecoder gives it, json metadata, caption)]:
    {"retrieval_top1", "colour_acc", "shape_acc", "n", "chance_retrieval"} (see the module
    docstring for the protocol and the prompts). The model's train/eval mode is restored."""
    if not samples:
        raise ValueError("zero_shot needs at least one sample")
    clip = _unwrap_clip(model)
    device = torch.device(device)
    was_training = model.training
    model.eval()
    try:
        images = torch.stack([s[0] for s in samples])
        img = torch.cat([clip.encode_image(images[i:i + batch_size].to(device), normalize=True).float()
                         for i in range(0, len(images), batch_size)])
        captions = [s[2] for s in samples]
        txt = _encode_texts(clip, tokenizer_fn, captions, device, batch_size)
        best = (img @ txt.T).argmax(dim=1).tolist()
        retrieval = sum(captions[j] == captions[i] for i, j in enumerate(best)) / len(samples)

        colour_prompts, shape_prompts = class_prompts()
        colours, colour_emb = _class_embeddings(clip, tokenizer_fn, colour_prompts, device)
        shapes, shape_emb = _class_embeddings(clip, tokenizer_fn, shape_prompts, device)
        pred_colour = (img @ colour_emb.T).argmax(dim=1).tolist()
        pred_shape = (img @ shape_emb.T).argmax(dim=1).tolist()
        targets = [s[1]["target"] for s in samples]
        colour_acc = sum(colours[p] == t[0] for p, t in zip(pred_colour, targets)) / len(samples)
        shape_acc = sum(shapes[p] == t[1] for p, t in zip(pred_shape, targets)) / len(samples)
    finally:
        model.train(was_training)
    return {"retrieval_top1": retrieval, "colour_acc": colour_acc, "shape_acc": shape_acc,
            "n": len(samples), "chance_retrieval": 1.0 / len(samples)}


def format_zero_shot(result: dict) -> str:
    from data import shapes as S
    return (f"zero-shot on {result['n']} samples: retrieval top-1 {result['retrieval_top1']:.3f} "
            f"(chance {result['chance_retrieval']:.3f}), target colour {result['colour_acc']:.3f} "
            f"(chance {1 / len(S.COLOURS):.3f}), target shape {result['shape_acc']:.3f} "
            f"(chance {1 / len(S.SHAPES):.3f})")
