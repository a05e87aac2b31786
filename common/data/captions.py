"""Captions and attributes of shard samples, shared by every text-conditioned pipeline."""
from __future__ import annotations

import json


def caption_of(sample: dict) -> str:
    """The sample's `txt` caption as a stripped str; ValueError (a corrupt sample) without one."""
    caption = sample.get("txt")
    if caption is None:
        raise ValueError("sample has no txt caption")
    return caption.decode("utf-8").strip() if isinstance(caption, bytes) else str(caption)


def precomputed_text_features(sample: dict):
    """(tokens float32 (L, W), mask bool (L,), id of the tower that made them) from the sample's
    text_emb.npy / text_mask.npy (python -m data.precompute --text-encoder), None without them."""
    if "text_emb.npy" not in sample:
        return None
    import io

    import numpy as np
    import torch
    meta = read_attributes(sample).get("text_emb") or {}
    tokens = np.load(io.BytesIO(sample["text_emb.npy"]), allow_pickle=False)
    mask = np.load(io.BytesIO(sample["text_mask.npy"]), allow_pickle=False)
    if tokens.ndim != 2 or mask.shape != tokens.shape[:1]:
        raise ValueError(f"text_emb.npy {tokens.shape} and text_mask.npy {mask.shape} do not match")
    return torch.from_numpy(tokens.astype(np.float32)), torch.from_numpy(mask.astype(bool)), str(meta.get("id", ""))


def read_attributes(sample: dict) -> dict:
    """The sample's `json` metadata (shape, colour, motion, size, ...), {} without one."""
    raw = sample.get("json")
    return json.loads(raw) if raw else {}


def first_examples(spec: str, n: int) -> list[tuple[str, dict]]:
    """(caption, attributes) of the first n samples of some shards, in shard order (no shuffle):
    the fixed held-out prompts of sample grids and eval."""
    from common.data.shards import iter_samples
    out = []
    for s in iter_samples(spec):
        if len(out) == n:
            break
        out.append((caption_of(s), read_attributes(s)))
    return out


def first_decoded(spec: str, n: int, required: set[str], decode, key: str, what: str):
    """The first n samples of some shards (shard order) whose attributes hold every `required` key,
    decoded: (decode(s)[key] stacked, their attributes, their captions). Samples for which decode
    returns None are skipped. ConfigError when none qualifies; `what` names the option that asked."""
    import torch

    from common.config import ConfigError
    from common.data.shards import iter_samples
    tensors, attrs, captions = [], [], []
    for s in iter_samples(spec):
        a = read_attributes(s)
        if not required <= set(a):
            continue
        d = decode(s)
        if d is None:
            continue
        tensors.append(d[key])
        captions.append(d["caption"])
        attrs.append(a)
        if len(tensors) == n:  # before the next read: the shards may be remote
            break
    if not tensors:
        raise ConfigError(f"{what}: the held-out shards have no samples with the attributes "
                          f"{', '.join(sorted(required))}")
    return torch.stack(tensors), attrs, captions
