"""The frozen open_clip text tower every text-conditioned pipeline shares (captions -> per-token
features for cross-attention), and the seeded way a run builds it."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# Salt of the frozen tower's init seed (mix_seed(run.seed, TEXT_SEED_SALT)): every rank, every
# resume, sample.py and data.precompute rebuild the same random tower from the run seed.
TEXT_SEED_SALT = 101

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


class TextEncoder(nn.Module):
    """Frozen open_clip TextTransformer returning per-token features for cross-attention.

    Built with open_clip's own `_build_text_tower` (causal CLIP text transformer, BPE tokenizer
    bundled with open_clip, so no network). Always in eval mode with requires_grad False; the
    forward runs under no_grad.
    """

    def __init__(self, cfg: TextEncoderConfig | None = None):
        super().__init__()
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
        self.requires_grad_(False)
        self.eval()

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

    def train(self, mode: bool = True):
        return super().train(False)  # frozen: never leave eval mode (no dropout)

    def tokenize(self, texts: list[str]) -> torch.Tensor:
        return self.tokenizer(list(texts))

    @torch.no_grad()
    def forward(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (tokens (B, L, width), key_padding_mask (B, L) bool, True = real token incl. SOT/EOT)."""
        ids = self.tokenize(texts).to(self.tower.token_embedding.weight.device)
        _, tokens = self.tower(ids)
        return tokens, ids != 0  # SimpleTokenizer pads with id 0


def build_text_encoder(text_cfg, run_seed: int) -> TextEncoder:
    """The tower a run's `text` config section describes (common.config.TextConfig), seeded from
    the run seed apart from the global RNG (which it leaves untouched)."""
    from common.diffusion.noise import mix_seed
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(mix_seed(run_seed, TEXT_SEED_SALT))
        return TextEncoder(TextEncoderConfig(width=text_cfg.width, layers=text_cfg.layers, heads=text_cfg.heads,
                                             context_length=text_cfg.context_length,
                                             weights=text_cfg.weights or None,
                                             layer_scale=text_cfg.layer_scale or None))
