"""Packed variable-length rows (common.data.packing) through the Llama decoder's varlen attention.

The exactness rule: packing never changes the loss. Per-sample losses from packed rows equal
those of every sample run alone (batch of one, no padding), and the gradients of the packed
token- and sample-averaged losses equal those of the same averages computed sample by sample,
in float64 to 1e-10. A control shows the boundary matters: without cu_seqlens the same rows give
other losses for every sample that is not first in its row.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.data.packing import IGNORE_INDEX, pack_samples, packed_loss, pad_batch, sample_losses
from common.kernels import use_backend
from common.nn import Llama, LlamaConfig

ROW = 32
VOCAB = 64
# Long-tailed lengths; 40 > ROW is skipped; sample 3 has no assistant token, sample 6 is one token.
LENGTHS = [3, 9, 17, 6, 30, 40, 1, 12, 5, 9, 24, 2]


def _samples(lengths=LENGTHS, seed=0):
    """Conversations: alternating user (mask False) and assistant (mask True) turns."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(1, VOCAB, (n,), generator=g)
        mask = torch.zeros(n, dtype=torch.bool)
        if i != 3:
            turn = torch.randint(0, 2, (n,), generator=g).cumsum(0) % 2 == 1
            mask = turn | (torch.arange(n) == n - 1)  # every conversation ends in an assistant token
        out.append((ids, mask))
    return out


def _model():
    torch.manual_seed(0)
    cfg = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, ffn_hidden=48,
                      max_seq_len=ROW, qk_norm=True)
    return Llama(cfg).double()


def _run(model, batch, varlen=True):
    kw = dict(cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen) if varlen else {}
    return model(batch.tokens, positions=batch.positions, **kw)


# ------------------------------------------------------------------------------------ packing
def test_packing_invariants():
    samples = _samples()
    b = pack_samples(samples, ROW)
    r, l = b.tokens.shape
    assert l == ROW and b.cu_seqlens.dtype == torch.int32
    assert (b.num_inputs, b.num_samples, b.num_skipped, b.skipped) == (12, 11, 1, (5,))
    assert b.num_pad == r * l - sum(n for n in LENGTHS if n <= ROW) == int((b.sample_index < 0).sum())
    assert b.num_no_loss == 2  # sample 3 (no assistant turn) and sample 6 (one token: nothing to predict)
    flat_idx, flat_tok = b.sample_index.flatten(), b.tokens.flatten()
    for i, (ids, mask) in enumerate(samples):
        where = (b.sample_index == i).nonzero()
        if i == 5:
            assert len(where) == 0
            continue
        # Every token once, contiguous in one row, positions restarting at 0.
        assert len(where) == len(ids) and where[:, 0].unique().numel() == 1
        assert torch.equal(where[:, 1], where[0, 1] + torch.arange(len(ids)))
        assert torch.equal(b.tokens[b.sample_index == i], ids)
        assert torch.equal(b.positions[b.sample_index == i], torch.arange(len(ids)))
        assert int((b.targets[b.sample_index == i] != IGNORE_INDEX).sum()) == int(mask[1:].sum())
    # A target is the next token of the same sample, and only an assistant one.
    pos = (b.targets.flatten() != IGNORE_INDEX).nonzero().flatten()
    assert torch.equal(flat_idx[pos + 1], flat_idx[pos])
    assert torch.equal(b.targets.flatten()[pos], flat_tok[pos + 1])
    masks = {i: m for i, (_, m) in enumerate(samples)}
    assert all(masks[int(flat_idx[p])][int(b.positions.flatten()[p]) + 1] for p in pos)
    # Padding: pad id, no target; segments tile the flattened batch, one owner each.
    pad = b.sample_index < 0
    assert (b.tokens[pad] == 0).all() and (b.targets[pad] == IGNORE_INDEX).all()
    cu = b.cu_seqlens.tolist()
    assert cu[0] == 0 and cu[-1] == r * l and all(x < y for x, y in zip(cu, cu[1:]))
    assert b.max_seqlen == max(y - x for x, y in zip(cu, cu[1:]))
    for x, y in zip(cu, cu[1:]):
        assert flat_idx[x:y].unique().numel() == 1
    assert sum(flat_idx[x] >= 0 for x in cu[:-1]) == b.num_samples
    # First-fit-decreasing: the 30-token sample opens row 0 and the 2-token one fills it.
    assert b.sample_index[0, :32].unique().tolist() == [4, 11]


def test_packing_is_deterministic_and_ties_keep_input_order():
    a, b = pack_samples(_samples(), ROW), pack_samples(_samples(), ROW)
    for name in ("tokens", "targets", "positions", "sample_index", "cu_seqlens"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    eq = pack_samples(_samples([5, 5, 5, 5, 5]), 10)
    assert eq.sample_index[:, ::5].tolist() == [[0, 1], [2, 3], [4, -1]]


def test_packing_edge_cases():
    with pytest.raises(ValueError, match="no samples"):
        pack_samples([], ROW)
    with pytest.raises(ValueError, match="sample 0: loss_mask must be a bool"):
        pack_samples([(torch.arange(3), torch.ones(3))], ROW)
    with pytest.raises(ValueError, match="sample 1 is empty"):
        pack_samples([(torch.arange(3), torch.ones(3, dtype=torch.bool)),
                      (torch.arange(0), torch.ones(0, dtype=torch.bool))], ROW)
    none = pack_samples(_samples([40, 50]), ROW)  # all too long: an empty batch, never a crash
    assert none.tokens.shape == (0, ROW) and none.num_skipped == 2 and none.cu_seqlens.tolist() == [0]
    full = pack_samples(_samples([8, 8]), 16)  # rows exactly full: no padding segment
    assert full.num_pad == 0 and full.cu_seqlens.tolist() == [0, 8, 16]


def test_pad_batch():
    samples = _samples()
    p = pad_batch(samples, ROW)
    assert p.tokens.shape == (11, 30) and p.cu_seqlens is None and p.skipped == (5,)
    assert p.num_pad == 11 * 30 - sum(n for n in LENGTHS if n <= ROW)
    assert torch.equal(p.positions, torch.arange(30).expand(11, 30))
    assert p.num_loss_tokens == pack_samples(samples, ROW).num_loss_tokens


# ------------------------------------------------------------------------------- exactness
def _alone(model, samples):
    """Per-sample (loss sum, loss-token count), each sample run by itself; targets built here,
    independently of the packing code."""
    sums, counts = {}, {}
    for i, (ids, mask) in enumerate(samples):
        if len(ids) > ROW:
            continue
        logits = model(ids[None])[0]
        tl = F.cross_entropy(logits[:-1], ids[1:], reduction="none")
        m = mask[1:]
        sums[i], counts[i] = (tl * m).sum(), int(m.sum())
    return sums, counts


def _grads(model, loss):
    # retain_graph: both reference averages are built on the same per-sample forwards.
    return torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_packed_equals_unpacked_losses_and_gradients(backend):
    samples = _samples()
    model = _model()
    with use_backend(backend):
        batch = pack_samples(samples, ROW)
        assert batch.tokens.shape[0] < len(samples) - 1  # really packed: several samples per row
        sums, counts = _alone(model, samples)
        per, count = sample_losses(_run(model, batch), batch)
        for i in sums:
            assert int(count[i]) == counts[i]
            ref = sums[i] / max(counts[i], 1)
            assert abs((per[i] - ref).item()) < 1e-10, (i, per[i].item(), ref.item())
        assert count[5] == 0  # the skipped one

        # The padded batch (plain causal rows) gives the same losses too.
        padded = pad_batch(samples, ROW)
        per_pad, _ = sample_losses(_run(model, padded, varlen=False), padded)
        torch.testing.assert_close(per_pad, per, rtol=0, atol=1e-10)

        token_ref = sum(sums.values()) / sum(counts.values())
        with_loss = [i for i in sums if counts[i]]
        sample_ref = sum(sums[i] / counts[i] for i in with_loss) / len(with_loss)
        for average, ref in (("token", token_ref), ("sample", sample_ref)):
            loss = packed_loss(_run(model, batch), batch, average=average)
            assert abs((loss - ref).item()) < 1e-10, average
            for g, g_ref in zip(_grads(model, loss), _grads(model, ref)):
                torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-10)
        # A per-token loss computed elsewhere (e.g. a fused kernel) gives the same averages.
        tl = F.cross_entropy(_run(model, batch).flatten(0, 1), batch.targets.flatten(),
                             reduction="none", ignore_index=IGNORE_INDEX).view(batch.targets.shape)
        assert abs((packed_loss(tl, batch) - token_ref).item()) < 1e-10


def test_without_varlen_boundaries_the_losses_differ():
    """The control: the same rows under plain causal attention let samples see their row
    neighbours. Row-leading samples are unaffected (nothing precedes them), which also shows
    the restarting positions are right; every other sample with loss tokens changes."""
    samples = _samples()
    model = _model()
    with use_backend("reference"), torch.no_grad():
        batch = pack_samples(samples, ROW)
        per, count = sample_losses(_run(model, batch), batch)
        leaky, _ = sample_losses(_run(model, batch, varlen=False), batch)
    leading = set(batch.sample_index[:, 0].tolist())
    later = [i for i in range(len(samples)) if count[i] > 0 and i not in leading]
    assert later and min(abs(float(per[i] - leaky[i])) for i in later) > 1e-6
    for i in leading:
        assert abs(float(per[i] - leaky[i])) < 1e-12


def test_loss_edge_cases():
    samples = [(torch.arange(1, 5), torch.zeros(4, dtype=torch.bool))]  # no assistant token at all
    batch = pack_samples(samples, 8)
    logits = torch.randn(1, 8, VOCAB, requires_grad=True)
    for average in ("token", "sample"):
        loss = packed_loss(logits, batch, average=average)
        assert loss.item() == 0.0
        loss.backward()  # still differentiable
    with pytest.raises(ValueError, match="average must be"):
        packed_loss(logits, batch, average="row")
    with pytest.raises(ValueError, match="do not match the batch"):
        packed_loss(logits[:, :4], batch)


# ------------------------------------------------------------------------------- the model
def test_llama_packed_row_checks():
    model = _model()
    batch = pack_samples(_samples(), ROW)
    with pytest.raises(ValueError, match="need per-row positions"):
        model(batch.tokens, cu_seqlens=batch.cu_seqlens)
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0"):
        model(batch.tokens, positions=batch.positions, cu_seqlens=batch.cu_seqlens[:-1])
    with pytest.raises(ValueError, match="positions .* do not match"):
        model(batch.tokens, positions=batch.positions[:, :-1])
    # A context-parallel attention receives the packed rows' offsets (it splits them itself).
    seen = {}

    def record(q, k, v, **kw):
        seen.update(kw)
        return torch.zeros_like(q)
    model.blocks[0].attention.attn_impl = record
    model(batch.tokens, positions=batch.positions, cu_seqlens=batch.cu_seqlens)
    model.blocks[0].attention.attn_impl = None
    assert torch.equal(seen["cu_seqlens"], batch.cu_seqlens) and seen["causal"] is True
    # The length limit is on the longest sequence: two rows of 32 fit max_seq_len 16 when packed
    # from 16-token samples, and not when one sequence is longer.
    short = Llama(LlamaConfig(dim=32, n_layers=1, n_heads=4, vocab_size=VOCAB, ffn_hidden=48, max_seq_len=16))
    ok = pack_samples(_samples([16, 16, 10, 6]), 32)
    assert short(ok.tokens, positions=ok.positions, cu_seqlens=ok.cu_seqlens).shape == (2, 32, VOCAB)
    bad = pack_samples(_samples([17, 15]), 32)
    with pytest.raises(ValueError, match="sequence length 17 exceeds max_seq_len 16"):
        short(bad.tokens, positions=bad.positions, cu_seqlens=bad.cu_seqlens)


def test_rope_per_row_positions_match_shared_tables():
    model = _model()
    pos = torch.tensor([[0, 1, 2, 0, 1], [3, 4, 0, 1, 2]])
    cos, sin = model.rope(positions=pos)
    assert cos.shape == (2, 1, 5, model.cfg.head_dim)
    for r in range(2):
        c, s = model.rope(positions=pos[r])
        assert torch.equal(cos[r, 0], c) and torch.equal(sin[r, 0], s)
