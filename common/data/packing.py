"""Packing variable-length samples (conversations) into fixed-length training rows.

A sample is `(token_ids, loss_mask)`, both 1-D of length n; loss_mask[j] is True when token j is
an assistant token the model must learn to produce. The mask is aligned with the tokens it marks
(target positions), so the loss at input position i predicts token i + 1 and counts when
loss_mask[i + 1] is True; loss_mask[0] never counts (nothing predicts a sample's first token).

`pack_samples` places samples into rows of `row_len` tokens by first-fit-decreasing and returns a
PackedBatch whose rows run through common.nn.Llama with varlen attention:

    logits = model(batch.tokens, positions=batch.positions, cu_seqlens=batch.cu_seqlens,
                   max_seqlen=batch.max_seqlen)
    loss = packed_loss(logits, batch, average="token")

cu_seqlens is one flattened (S + 1,) int32 tensor over all R * L tokens, the layout of the
kernels' varlen attention (common/kernels/attention.py): every sample is a segment, and each
row's padding tail is a segment of its own, so the segments tile the flattened batch exactly
and no real token ever attends to padding. `pad_batch` builds the one-sample-per-row padded
equivalent (cu_seqlens None: plain causal attention) for comparisons and benchmarks.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # torch cross-entropy's default ignore_index

Sample = tuple[torch.Tensor, torch.Tensor]


@dataclass
class PackedBatch:
    tokens: torch.Tensor            # (R, L) long; padding holds pad_id
    targets: torch.Tensor           # (R, L) long; IGNORE_INDEX: no loss (non-assistant, sample end, padding)
    positions: torch.Tensor         # (R, L) long; 0.. per sample (padding: 0)
    sample_index: torch.Tensor      # (R, L) long; index of the token's input sample, -1 for padding
    cu_seqlens: torch.Tensor | None  # (S + 1,) int32 over the flattened R * L tokens; None: one sample per row
    max_seqlen: int                 # longest segment of cu_seqlens (the row length when None)
    num_inputs: int                 # len(samples) given; sample_index < num_inputs
    num_samples: int                # samples in the batch
    num_skipped: int                # samples longer than the row, left out
    num_pad: int                    # pad tokens
    num_loss_tokens: int            # targets != IGNORE_INDEX
    num_no_loss: int                # samples in the batch without a loss token (left out of per-sample averages)
    skipped: tuple[int, ...] = ()   # input indices of the skipped samples

    @property
    def pad_fraction(self) -> float:
        return self.num_pad / max(self.tokens.numel(), 1)

    def to(self, device) -> PackedBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device)
        return PackedBatch(**moved)


def _check(samples: Sequence[Sample]) -> list[int]:
    if len(samples) == 0:
        raise ValueError("no samples to pack (empty input)")
    lengths = []
    for i, (ids, mask) in enumerate(samples):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"sample {i}: token_ids must be a 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}")
        if mask.dtype != torch.bool or mask.shape != ids.shape:
            raise ValueError(f"sample {i}: loss_mask must be a bool tensor shaped like token_ids {tuple(ids.shape)}, "
                             f"got {mask.dtype} {tuple(mask.shape)}")
        if ids.numel() == 0:
            raise ValueError(f"sample {i} is empty")
        lengths.append(ids.numel())
    return lengths


def _targets(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # Position i predicts token i + 1; the last token predicts nothing, so no target crosses
    # into whatever follows the sample in its row.
    nxt = torch.full_like(ids, IGNORE_INDEX)
    nxt[:-1] = torch.where(mask[1:], ids[1:], IGNORE_INDEX)
    return nxt


def _assemble(rows: list[list[int]], samples: Sequence[Sample], row_len: int, pad_id: int,
              packed: bool, skipped: list[int]) -> PackedBatch:
    n_rows = len(rows)
    tokens = torch.full((n_rows, row_len), pad_id, dtype=torch.long)
    targets = torch.full((n_rows, row_len), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros((n_rows, row_len), dtype=torch.long)
    sample_index = torch.full((n_rows, row_len), -1, dtype=torch.long)
    bounds, no_loss = [0], 0
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            ids, mask = samples[i]
            n = ids.numel()
            tokens[r, at:at + n] = ids
            targets[r, at:at + n] = _targets(ids.long(), mask)
            positions[r, at:at + n] = torch.arange(n)
            sample_index[r, at:at + n] = i
            no_loss += not bool(mask[1:].any())
            at += n
            bounds.append(r * row_len + at)
        if packed:
            positions[r, at:] = 0
        else:  # a padded row is one ordinary causal sequence: positions run on through the padding
            positions[r, at:] = torch.arange(at, row_len)
        if at < row_len:
            bounds.append((r + 1) * row_len)
    cu = torch.tensor(bounds, dtype=torch.int32) if packed else None
    seg = max((b - a for a, b in zip(bounds, bounds[1:])), default=0) if packed else row_len
    n_samples = sum(len(m) for m in rows)
    n_pad = int((sample_index < 0).sum())
    n_loss = int((targets != IGNORE_INDEX).sum())
    return PackedBatch(tokens, targets, positions, sample_index, cu, seg, len(samples), n_samples,
                       len(skipped), n_pad, n_loss, no_loss, tuple(skipped))


def pack_samples(samples: Sequence[Sample], row_len: int, *, pad_id: int = 0) -> PackedBatch:
    """Pack samples into rows of `row_len` tokens, first-fit-decreasing by length (ties by input
    order, so the result is deterministic). The number of rows is what the samples need. A sample
    longer than row_len is skipped and counted; if every sample is, the batch has zero rows.
    Within a row, samples keep the order in which they were placed."""
    if row_len < 1:
        raise ValueError(f"row_len must be >= 1, got {row_len}")
    lengths = _check(samples)
    free: list[int] = []
    rows: list[list[int]] = []
    skipped = [i for i, n in enumerate(lengths) if n > row_len]
    for i in sorted((i for i, n in enumerate(lengths) if n <= row_len), key=lambda i: (-lengths[i], i)):
        # Linear scan: fine for a loader batch (hundreds of samples, tens of rows).
        r = next((r for r, f in enumerate(free) if f >= lengths[i]), None)
        if r is None:
            r = len(rows)
            rows.append([])
            free.append(row_len)
        rows[r].append(i)
        free[r] -= lengths[i]
    return _assemble(rows, samples, row_len, pad_id, True, skipped)


def pad_batch(samples: Sequence[Sample], max_len: int | None = None, *, pad_id: int = 0) -> PackedBatch:
    """The padded equivalent of pack_samples: one sample per row in input order, right-padded to
    the longest. Samples longer than max_len (when given) are skipped and counted, so the same
    row length keeps the same samples as pack_samples. cu_seqlens is None: rows are ordinary
    causal sequences (padding sits after the sample, so causality keeps it out of the loss)."""
    lengths = _check(samples)
    skipped = [i for i, n in enumerate(lengths) if max_len is not None and n > max_len]
    kept = [i for i, n in enumerate(lengths) if max_len is None or n <= max_len]
    row_len = max((lengths[i] for i in kept), default=0)
    return _assemble([[i] for i in kept], samples, row_len, pad_id, False, skipped)


def segments_from_positions(positions: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens (S + 1,) int32, longest segment) of rows whose positions restart at 0 where a
    segment starts (a sample, or a row's padding tail counted as one segment): what a model that
    receives only row-batched tensors (split along dim 0 by data or pipeline parallelism) rebuilds
    the varlen offsets from. One device sync, for the longest segment."""
    flat = positions.reshape(-1)
    starts = torch.nonzero(flat == 0).squeeze(1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("packed rows must start every row with position 0")
    cu = torch.cat([starts, torch.tensor([flat.numel()], device=flat.device)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


# --------------------------------------------------------------------------------------- loss
def token_losses(logits_or_token_loss: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Per-token loss (R, L), zero wherever the target is IGNORE_INDEX. Takes logits (R, L, V)
    (plain cross-entropy) or an already computed per-token loss (R, L)."""
    x, tgt = logits_or_token_loss, batch.targets
    if x.dim() == 3:
        if x.shape[:2] != tgt.shape:
            raise ValueError(f"logits {tuple(x.shape)} do not match the batch {tuple(tgt.shape)}")
        # Half-precision logits would round the log-sum-exp; fp32/fp64 stay as they are.
        x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        loss = F.cross_entropy(x.flatten(0, 1), tgt.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
        return loss.view(tgt.shape)
    if x.shape != tgt.shape:
        raise ValueError(f"per-token loss {tuple(x.shape)} does not match the batch {tuple(tgt.shape)}")
    return torch.where(tgt != IGNORE_INDEX, x, torch.zeros_like(x))  # where, not *: a NaN on padding stays out


def sample_losses(logits_or_token_loss: torch.Tensor, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean token loss, loss-token count), each (num_inputs,), indexed like the input samples;
    a sample without loss tokens (or skipped) has loss 0 and count 0."""
    loss = token_losses(logits_or_token_loss, batch).flatten()
    idx = batch.sample_index.flatten()
    counted = (batch.targets.flatten() != IGNORE_INDEX) & (idx >= 0)
    # Slot num_inputs collects padding and non-loss tokens (their loss is 0 anyway) and is dropped.
    slot = torch.where(counted, idx, batch.num_inputs)
    total = loss.new_zeros(batch.num_inputs + 1).index_add(0, slot, loss)[:-1]
    count = torch.bincount(slot, minlength=batch.num_inputs + 1)[:-1]
    return total / count.clamp_min(1).to(total.dtype), count


def packed_loss(logits_or_token_loss: torch.Tensor, batch: PackedBatch, average: str = "token") -> torch.Tensor:
    """Scalar loss over the batch's assistant tokens. average="token": mean over all loss tokens
    (long answers weigh more); "sample": mean over samples of each sample's mean token loss
    (samples without loss tokens are left out; batch.num_no_loss counts them). A batch with no
    loss token gives 0 (still differentiable). Averages are over this batch only: with gradient
    accumulation or data parallelism the caller rescales to the global count."""
    if average == "token":
        # Counts come from the batch (known at packing time): no device sync.
        return token_losses(logits_or_token_loss, batch).sum() / max(batch.num_loss_tokens, 1)
    if average == "sample":
        per_sample, _ = sample_losses(logits_or_token_loss, batch)
        return per_sample.sum() / max(batch.num_samples - batch.num_no_loss, 1)
    raise ValueError(f"average must be 'token' or 'sample', got {average!r}")
