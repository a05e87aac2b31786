"""Greedy decoding for the Llama decoder (common/nn/llama.py), batched through packed varlen rows.

Several prompts of different lengths (token ids or embeddings, e.g. image features spliced into
a conversation) decode together: every step packs all unfinished sequences into one row with
`cu_seqlens`, so no padding and no attention mask are needed and each sequence sees only itself.
There is no KV cache: each step recomputes the prefixes, which is what short answers (a few tokens
after a prompt of ~100) cost least code for; long generations want a cache.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


@torch.no_grad()
def greedy_generate(model, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                    stop_ids: Sequence[int] = ()) -> list[list[int]]:
    """prompts: per sequence, token ids (L_i,) int64 or embeddings (L_i, dim). Returns the new
    tokens of each sequence; a sequence stops after emitting a stop id (kept in its output) or
    after max_new_tokens. The argmax is taken in fp32 (ties: the lowest token id)."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    emb = model.tok_embeddings
    seqs = [emb(p) if not p.is_floating_point() else p for p in prompts]
    if any(s.dim() != 2 or s.shape[0] == 0 for s in seqs):
        raise ValueError("each prompt must be non-empty: token ids (L,) or embeddings (L, dim)")
    out: list[list[int]] = [[] for _ in seqs]
    live = list(range(len(seqs)))
    stop = set(int(i) for i in stop_ids)
    for _ in range(max_new_tokens):
        if not live:
            break
        rows = [seqs[i] for i in live]
        lengths = [r.shape[0] for r in rows]
        flat = torch.cat(rows).unsqueeze(0)
        device = flat.device
        cu = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
        positions = torch.cat([torch.arange(n, device=device) for n in lengths]).unsqueeze(0)
        logits = model(inputs_embeds=flat, positions=positions, cu_seqlens=cu, max_seqlen=max(lengths))
        last = logits[0, (cu[1:] - 1).long()].float()  # each sequence's final position
        nxt = last.argmax(-1)
        still = []
        for i, tok in zip(live, nxt.tolist()):
            out[i].append(tok)
            seqs[i] = torch.cat([seqs[i], emb(torch.tensor([tok], device=device))])
            if tok not in stop:
                still.append(i)
        live = still
    return out
