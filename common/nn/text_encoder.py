"""The frozen text tower every text-conditioned pipeline shares (captions -> per-token features for
cross-attention): open_clip's text transformer seeded from the run seed (or loaded from a state
dict), or a Hugging Face CLIP / T5 text encoder from a local folder, or Stable Diffusion 3's three
encoders from its pipeline folder; and the way a run builds it.

All give forward(texts) -> (tokens (B, L, width), mask (B, L) bool) and .width; the single towers
also tokenize(texts)."""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

# Salt of the frozen tower's init seed (mix_seed(run.seed, TEXT_SEED_SALT)): every rank, every
# resume, sample.py and data.precompute rebuild the same random tower from the run seed.
TEXT_SEED_SALT = 101

# open_clip's optional towers that no pipeline builds through open_clip (its Hugging Face text
# towers and timm vision towers): importing them is ~1.9 s of every process's start-up, a fifth
# of a short training run on 2 cores.
_OPEN_CLIP_OPTIONAL = ("transformers", "timm")


def import_open_clip():
    """`import open_clip`, without loading its optional Hugging Face and timm backends when they
    are not loaded already. open_clip falls back as if they were not installed, for its own
    HF-text / timm-vision models only; afterwards `import transformers` / `import timm` work as
    usual (the project's HF encoders and diffusers import them directly)."""
    if "open_clip" in sys.modules:
        return sys.modules["open_clip"]
    blocked = [name for name in _OPEN_CLIP_OPTIONAL if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # `import name` raises ImportError, which open_clip catches
    try:
        import open_clip
    finally:
        for name in blocked:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]
    return open_clip


@dataclass
class TextEncoderConfig:
    width: int = 128
    layers: int = 2
    heads: int = 4
    context_length: int = 32
    vocab_size: int = 49408
    weights: str | None = None  # local state-dict file (open_clip text keys); None = random init
    # open_clip LayerScale on the residual branches (None: plain CLIP blocks, as pretrained
    # checkpoints have). A small value keeps a *random* frozen tower close to its token
    # embeddings: without it, random attention/MLP branches outweigh the embeddings and hash each
    # word together with its prefix, so "circle" after "red" and after "blue" look unrelated.
    layer_scale: float | None = None


class FrozenTower(nn.Module):
    """A text tower that never trains: no gradients, and always in eval mode (no dropout)."""

    def freeze(self) -> None:
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True):
        return super().train(False)


class FolderTower(FrozenTower):
    """A frozen tower whose weights are those of the local folder `path`: checkpoints record their
    fingerprint, not the weights (common.frozen_weights.FrozenModules reads `weights_folder`)."""

    path: str

    @property
    def weights_folder(self) -> str:
        return self.path


class TextEncoder(FrozenTower):
    """Frozen open_clip TextTransformer returning per-token features for cross-attention.

    Built with open_clip's own `_build_text_tower` (causal CLIP text transformer, BPE tokenizer
    bundled with open_clip, so no network). Always in eval mode with requires_grad False; the
    forward runs under no_grad.
    """

    def __init__(self, cfg: TextEncoderConfig | None = None):
        super().__init__()
        import_open_clip()
        from open_clip.model import CLIPTextCfg, _build_text_tower
        from open_clip.tokenizer import SimpleTokenizer

        self.cfg = cfg = cfg or TextEncoderConfig()
        text_cfg = CLIPTextCfg(context_length=cfg.context_length, vocab_size=cfg.vocab_size, width=cfg.width,
                               heads=cfg.heads, layers=cfg.layers, output_tokens=True, proj_type="none",
                               ls_init_value=cfg.layer_scale)
        self.tower = _build_text_tower(cfg.width, text_cfg)
        self.tokenizer = SimpleTokenizer(context_length=cfg.context_length)
        if cfg.weights:
            self.load_weights(cfg.weights)
        self.freeze()

    @property
    def width(self) -> int:
        return self.cfg.width

    def load_weights(self, path: str) -> None:
        """Load a text-tower or full CLIP state dict (keys not in the tower, e.g. visual.*, are
        ignored; a tower key missing from the file is an error)."""
        sd = torch.load(path, map_location="cpu", weights_only=True)
        sd = sd.get("state_dict", sd)
        sd = {k.removeprefix("module."): v for k, v in sd.items()}
        own = self.tower.state_dict()
        missing = [k for k in own if k not in sd]
        if missing:
            raise KeyError(f"text encoder weights {path} lack keys: {missing[:5]}...")
        self.tower.load_state_dict({k: sd[k] for k in own})

    def tokenize(self, texts: list[str]) -> torch.Tensor:
        return self.tokenizer(list(texts))

    @torch.no_grad()
    def forward(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (tokens (B, L, width) fp32, key_padding_mask (B, L) bool, True = real token incl. SOT/EOT)."""
        ids = self.tokenize(texts).to(self.tower.token_embedding.weight.device)
        _, tokens = self.tower(ids)
        return tokens.float(), ids != 0  # SimpleTokenizer pads with id 0


# transformers model_type -> the encoder-only class that reads it (a full CLIPModel folder loads
# its text half).
_HF_TEXT_MODELS = {"clip": "CLIPTextModel", "clip_text_model": "CLIPTextModel", "t5": "T5EncoderModel",
                   "mt5": "T5EncoderModel", "umt5": "UMT5EncoderModel"}


def hf_tokenizer_dir(path: str) -> str:
    """The tokenizer's folder for a text encoder folder: the folder itself, else a `tokenizer`
    folder beside it (the layout of a diffusers pipeline folder)."""
    import os
    sibling = os.path.join(os.path.dirname(os.path.normpath(path)), "tokenizer")
    own = any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json",
                                                               "spiece.model"))
    return path if own or not os.path.isdir(sibling) else sibling


def hf_tokenize(tokenizer, texts: list[str], context_length: int) -> dict:
    """A transformers tokenizer's ids and attention mask, padded / truncated to context_length."""
    return tokenizer(list(texts), padding="max_length", max_length=context_length, truncation=True,
                     return_tensors="pt")


def hf_text_features(model, tokenizer, texts: list[str], context_length: int,
                     padding_mask: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(last hidden state (B, L, width), mask (B, L) bool) of a transformers text encoder, captions
    padded / truncated to exactly `context_length` tokens; the encoder sees the mask when
    padding_mask (else the padded ids alone, as Stable Diffusion's CLIP does). Shared by
    HFTextEncoder and the exported diffusers pipeline, so both encode a caption the same way."""
    enc = hf_tokenize(tokenizer, texts, context_length)
    device = next(model.parameters()).device
    ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    with torch.no_grad():
        tokens = model(input_ids=ids, attention_mask=mask if padding_mask else None).last_hidden_state
    return tokens, mask.bool()


class HFTextEncoder(FolderTower):
    """A frozen transformers CLIP or T5 text encoder and the tokenizer from the same local folder
    (or a `tokenizer` folder beside it), behind TextEncoder's interface."""

    def __init__(self, path: str, context_length: int, padding_mask: bool = True, dtype: torch.dtype = torch.float32):
        super().__init__()
        import os

        import transformers
        from common.config import ConfigError
        from common.hf_folders import weights_variant
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"text.hf_path={path!r} is not a Hugging Face model folder (no config.json)")
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        cls_name = _HF_TEXT_MODELS.get(config.model_type)
        if cls_name is None:
            raise ConfigError(f"text.hf_path={path!r} holds a {config.model_type!r} model; supported text encoders: "
                              f"{', '.join(sorted(_HF_TEXT_MODELS))}")
        # `dtype` (text.dtype) whatever the folder's (the pipeline's precision policy casts activations).
        self.model = getattr(transformers, cls_name).from_pretrained(path, local_files_only=True, dtype=dtype,
                                                                     variant=weights_variant(path))
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(hf_tokenizer_dir(path), local_files_only=True)
        limit = getattr(self.model.config, "max_position_embeddings", None)  # CLIP: learned positions
        if limit is not None and context_length > limit:
            raise ConfigError(f"text.context_length={context_length} exceeds the {limit} positions of the text encoder "
                              f"at {path}")
        self.path, self.context_length, self.padding_mask = path, context_length, padding_mask
        self.freeze()

    @property
    def width(self) -> int:
        return self.model.config.hidden_size  # T5: alias of d_model

    def tokenize(self, texts: list[str]) -> torch.Tensor:
        return hf_tokenize(self.tokenizer, texts, self.context_length)["input_ids"]

    @torch.no_grad()
    def forward(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (tokens (B, L, width) fp32, key_padding_mask (B, L) bool, True = real token incl. BOS/EOS)."""
        tokens, mask = hf_text_features(self.model, self.tokenizer, texts, self.context_length, self.padding_mask)
        return tokens.float(), mask


def is_sd3_text_folder(path: str) -> bool:
    """Whether `path` is a diffusers pipeline folder with Stable Diffusion 3's three text encoders
    (model_index.json naming text_encoder, text_encoder_2 and text_encoder_3)."""
    import json
    import os
    index = os.path.join(path, "model_index.json")
    if not os.path.isfile(index):
        return False
    with open(index) as f:
        held = json.load(f)
    return all(k in held for k in ("text_encoder", "text_encoder_2", "text_encoder_3"))


class SD3TextEncoders(FolderTower):
    """Stable Diffusion 3's frozen text stack from its local pipeline folder, encoding a caption as
    diffusers' StableDiffusion3Pipeline does: CLIP-L (text_encoder/) and CLIP-G (text_encoder_2/),
    each on the caption padded to its tokenizer's length (77), give their penultimate hidden
    states, concatenated along features and zero-padded to T5's width, and their projected pooled
    outputs, concatenated (CLIP-L 768 + CLIP-G 1280 = 2048); T5-XXL (text_encoder_3/) gives its
    last hidden state on the caption padded to text.context_length (SD3: 256). Behind TextEncoder's
    interface, forward(texts) -> (tokens (B, 1 + 77 + context_length, width), mask all True: SD3
    attends to every position): row 0 holds the pooled vector (its first `pooled_width` features,
    zeros after), then the CLIP tokens, then the T5 tokens. Weights are the folder's (~22 GB in
    fp32, which checkpoints do not copy: FolderTower)."""

    padding_mask = False  # every position is attended, padding included, as SD3 was trained

    def __init__(self, path: str, context_length: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        import os

        import transformers
        from common.config import ConfigError
        from common.hf_folders import weights_variant

        def load(sub: str, cls_name: str):
            folder = os.path.join(path, sub)
            if not os.path.isfile(os.path.join(folder, "config.json")):
                raise ConfigError(f"text.hf_path={path!r}: no {sub}/config.json (SD3's text stack needs "
                                  "text_encoder/, text_encoder_2/ and text_encoder_3/ with their tokenizers)")
            model = getattr(transformers, cls_name).from_pretrained(folder, local_files_only=True, dtype=dtype,
                                                                    variant=weights_variant(folder))
            tok_dir = os.path.join(path, sub.replace("text_encoder", "tokenizer"))
            return model, transformers.AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)

        (self.clip_l, self.tok_l), (self.clip_g, self.tok_g) = (
            load("text_encoder", "CLIPTextModelWithProjection"), load("text_encoder_2", "CLIPTextModelWithProjection"))
        self.t5, self.tok_t5 = load("text_encoder_3", "T5EncoderModel")
        self.clip_length = self.tok_l.model_max_length  # as the pipeline: CLIP-L's tokenizer sets both
        self.pooled_width = self.clip_l.config.projection_dim + self.clip_g.config.projection_dim
        clip_width = self.clip_l.config.hidden_size + self.clip_g.config.hidden_size
        if max(clip_width, self.pooled_width) > self.width:
            raise ConfigError(f"text.hf_path={path!r}: CLIP features of width {clip_width} (pooled "
                              f"{self.pooled_width}) do not fit T5's width {self.width}")
        self.path, self.context_length = path, context_length
        self.freeze()

    @property
    def width(self) -> int:
        return self.t5.config.d_model

    @property
    def num_positions(self) -> int:
        return 1 + self.clip_length + self.context_length

    @torch.no_grad()
    def forward(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.t5.device
        pooled, clip_tokens = [], []
        for model, tok in ((self.clip_l, self.tok_l), (self.clip_g, self.tok_g)):
            ids = tok(list(texts), padding="max_length", max_length=self.clip_length, truncation=True,
                      return_tensors="pt").input_ids.to(device)
            out = model(ids, output_hidden_states=True)
            pooled.append(out.text_embeds)
            clip_tokens.append(out.hidden_states[-2])
        clip = torch.cat(clip_tokens, -1)
        ids = self.tok_t5(list(texts), padding="max_length", max_length=self.context_length, truncation=True,
                          add_special_tokens=True, return_tensors="pt").input_ids.to(device)
        t5 = self.t5(ids).last_hidden_state
        pad = lambda x: nn.functional.pad(x, (0, self.width - x.shape[-1]))  # noqa: E731
        tokens = torch.cat([pad(torch.cat(pooled, -1)).unsqueeze(1), pad(clip), t5], 1).float()
        return tokens, torch.ones(tokens.shape[:2], dtype=torch.bool, device=device)


TEXT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # text.dtype: a frozen tower's weights


def folder_text_encoder(text_cfg, dtype: torch.dtype) -> HFTextEncoder | SD3TextEncoders:
    """The tower of text.hf_path at its own width: SD3's three encoders for an SD3 pipeline folder,
    else the folder's CLIP or T5 encoder."""
    if is_sd3_text_folder(text_cfg.hf_path):
        return SD3TextEncoders(text_cfg.hf_path, text_cfg.context_length, dtype)
    return HFTextEncoder(text_cfg.hf_path, text_cfg.context_length, getattr(text_cfg, "hf_padding_mask", True), dtype)


def build_text_encoder(text_cfg, run_seed: int,
                       sd3_stack: bool = False) -> TextEncoder | HFTextEncoder | SD3TextEncoders:
    """The tower a run's `text` config section describes (common.config.TextConfig): the Hugging
    Face encoder of text.hf_path (SD3's three encoders when it is an SD3 pipeline folder, for a
    caller whose model reads their pooled row: sd3_stack), else open_clip's seeded from the run
    seed apart from the global RNG (which it leaves untouched)."""
    from common.config import ConfigError
    from common.diffusion.noise import mix_seed
    dtype = TEXT_DTYPES.get(getattr(text_cfg, "dtype", "fp32"))
    if dtype is None:
        raise ConfigError(f"text.dtype={text_cfg.dtype!r}: choose one of {', '.join(TEXT_DTYPES)}")
    if getattr(text_cfg, "hf_path", ""):
        if is_sd3_text_folder(text_cfg.hf_path) and not sd3_stack:
            raise ConfigError(f"text.hf_path={text_cfg.hf_path} is a Stable Diffusion 3 pipeline folder: its three "
                              "text encoders feed an SD3 transformer only (text2image model.arch=sd3); for another "
                              "model point text.hf_path at one of them, e.g. its text_encoder_3/ (T5)")
        enc = folder_text_encoder(text_cfg, dtype)
        if enc.width != text_cfg.width:
            raise ConfigError(f"text.width={text_cfg.width} but the text encoder at {text_cfg.hf_path} has width "
                              f"{enc.width}; set text.width={enc.width}")
        return enc
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(mix_seed(run_seed, TEXT_SEED_SALT))
        return TextEncoder(TextEncoderConfig(width=text_cfg.width, layers=text_cfg.layers, heads=text_cfg.heads,
                                             context_length=text_cfg.context_length,
                                             weights=text_cfg.weights or None,
                                             layer_scale=text_cfg.layer_scale or None)).to(dtype)


def text_features_id(text_encoder) -> str:
    """Which features a frozen tower gives a caption: its class, the fingerprint of its weights
    (common.frozen_weights.weights_fingerprint), its token count and whether it masks padding.
    Precomputed features (python -m data.precompute --text-encoder) carry it; a run takes them
    only from shards whose id is its own tower's."""
    from common.frozen_weights import weights_fingerprint
    length = getattr(text_encoder, "context_length", None) or text_encoder.cfg.context_length
    masked = int(getattr(text_encoder, "padding_mask", True))
    return f"{type(text_encoder).__name__}-{weights_fingerprint(text_encoder)}-L{length}-mask{masked}"


def text_signature(text_cfg) -> dict:
    """The `text` part of a checkpoint's signature: the tower's shape. The weights file is left
    out (its tensors are saved with the checkpoint), and so are an unset hf_path and the default
    hf_padding_mask and dtype, so that checkpoints written before those fields existed still load."""
    import dataclasses
    return {k: v for k, v in dataclasses.asdict(text_cfg).items()
            if k != "weights" and not (k == "hf_path" and not v) and not (k == "hf_padding_mask" and v)
            and not (k == "dtype" and v == "fp32")}
