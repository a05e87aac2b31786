"""Ring attention: the K/V blocks of a sequence-sharded attention travel round the CP ring.

Used by common.parallel.context_parallel (ring and hybrid modes). Forward: partial outputs of
each block are merged by log-sum-exp, the next block's transfer posted before the current
block is computed. Backward: FlashAttention-style block gradients from the final LSE, K/V sent
round again together with their dK/dV accumulators, so no rank ever holds the full K/V.
Causal attention is planned per block pair from global positions (zig-zag or contiguous shards).

Packed rows (`_Packed`): each batch row holds several documents back to back and a query sees
only keys of its own document (at or before it when causal). Per block pair the plan keeps the
rows and key ranges that can meet (interval arithmetic on the documents' row-local bounds, no
mask materialised for planning), skips pairs that cannot meet at all, and takes the dense calls
(full / causal diagonal, no mask) where every batch row's block lies inside one document; the
rest get a boolean document mask built on the fly from per-row document ids and positions.
"""
from __future__ import annotations

import math
from bisect import bisect_right

import torch
import torch.distributed as dist

from common.kernels import attention as _kernel_attention
from common.kernels import attention_reference


def _exchange(send: torch.Tensor, recv: torch.Tensor, ring, tag: int):
    """Send to the next ring rank and receive from the previous one, batched so that NCCL
    posts both sides together (separate isend/irecv pairs can deadlock there)."""
    ops = [dist.P2POp(dist.isend, send, ring.next_peer, ring.group, tag),
           dist.P2POp(dist.irecv, recv, ring.prev_peer, ring.group, tag)]
    return dist.batch_isend_irecv(ops)


def _wait(reqs):
    for r in reqs:
        r.wait()


# ----------------------------------------------------------------------------- ring planning
# A "segment" is a run of local rows holding consecutive global positions:
# (local_start, global_start, length). Each position has one owner, so two segments of different
# participants are disjoint ranges (one wholly before the other), and a participant's query and
# key segments are the same list: under causality a (query, key) segment pair is fully visible,
# fully hidden, or the same range (the ordinary causal diagonal); nothing else can occur.

def _merge_adjacent(segs):
    out = []
    for lo, g, n in segs:
        if out and out[-1][0] + out[-1][2] == lo and out[-1][1] + out[-1][2] == g:
            plo, pg, pn = out[-1]
            out[-1] = (plo, pg, pn + n)
        else:
            out.append((lo, g, n))
    return out


def _truncate(segs, seq_len):
    """Drop padding (global positions >= seq_len); padding always sits at a segment's end."""
    out = []
    for lo, g, n in segs:
        n = min(n, seq_len - g)
        if n > 0:
            out.append((lo, g, n))
    return out


def _plan(q_segs, k_segs, causal: bool, q_rows: int):
    """Attention calls for one (query block, key block) pair: a list of (q_lo, q_hi, k_ranges,
    diag) where k_ranges are local (lo, hi) rows of the key block to concatenate and diag marks
    the causal diagonal. Without causality all valid keys go in one call with every query row."""
    if not k_segs:
        return []
    if not causal:
        return [(0, q_rows, [(lo, lo + n) for lo, _, n in k_segs], False)]
    calls = []
    for qlo, qg, qn in q_segs:
        full = [(klo, klo + kn) for klo, kg, kn in k_segs if kg + kn <= qg]  # every key before every query
        if full:
            calls.append((qlo, qlo + qn, full, False))
        for klo, kg, kn in k_segs:
            if kg == qg:  # same range (see above); the remaining segments lie wholly after
                calls.append((qlo, qlo + qn, [(klo, klo + kn)], True))
    return calls


class _Ring:
    """Static description of one ring: group, peers and every participant's segments."""

    def __init__(self, group, segs_per_participant, seq_len, causal, scale):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next_peer = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev_peer = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.all_segs = [sorted(s) for s in segs_per_participant]  # padding included: row -> position
        self.segs = [_truncate(s, seq_len) for s in segs_per_participant]
        self.causal, self.scale = causal, scale
        self._plans = {}

    def plan(self, src: int, q_rows: int):
        if src not in self._plans:
            self._plans[src] = _plan(self.segs[self.rank], self.segs[src], self.causal, q_rows)
        return self._plans[src]


class _Packed:
    """Packed rows seen by one ring: which (query row, key row) pairs of a block pair may meet.

    starts: per batch row, the row-local start of each document, increasing, with the row
    length (the true sequence length) appended. doc: (B, padded length) long on the device, a
    document id per position (ids unique over the batch; padding -1, never planned).
    A query at row-local position i sees key j iff both lie in one document (and j <= i when
    causal). Documents are intervals, so for a query run Q and a key run K the rows of Q that
    see some key of K form one interval, and so do the keys of K seen by some row of Q: the
    plan keeps those bounds (over the batch rows), which makes fully masked pairs cost nothing.
    """

    def __init__(self, ring: _Ring, starts: list[list[int]], doc: torch.Tensor, causal: bool):
        self.ring, self.starts, self.causal = ring, starts, causal
        self.pos = [torch.cat([torch.arange(g, g + n, device=doc.device) for _, g, n in segs])
                    for segs in ring.all_segs]  # global position of every local row
        self.doc = [doc[:, p] for p in self.pos]  # (B, rows) per participant
        self._plans = {}

    @staticmethod
    def _span(starts, p):
        """(start, end) of the document holding row-local position p."""
        i = bisect_right(starts, p) - 1
        return starts[i], starts[i + 1]

    def _bounds(self, qg, qn, kg, kn):
        """Over all batch rows: the global query positions [qa, qb) of run (qg, qn) that see a
        key of run (kg, kn), and the keys [ka, kb) seen; None when no pair may meet."""
        span = self._span
        qa = ka = math.inf
        qb = kb = -math.inf
        for st in self.starts:
            if self.causal:  # i sees j iff start(i) <= j <= i
                a, b = max(qg, kg), min(qg + qn, span(st, kg + kn - 1)[1])
                c, d = max(kg, span(st, qg)[0]), min(kg + kn, qg + qn)
            else:  # i sees j iff same document
                a, b = max(qg, span(st, kg)[0]), min(qg + qn, span(st, kg + kn - 1)[1])
                c, d = max(kg, span(st, qg)[0]), min(kg + kn, span(st, qg + qn - 1)[1])
            if a < b and c < d:
                qa, qb, ka, kb = min(qa, a), max(qb, b), min(ka, c), max(kb, d)
        return None if qa == math.inf else (qa, qb, ka, kb)

    def _kind(self, qa, qb, ka, kb):
        """"full" (every query sees every key), "diag" (plain causal on one range) or "mask"."""
        for st in self.starts:
            s = self._span(st, qa)
            if not (s == self._span(st, qb - 1) == self._span(st, ka) == self._span(st, kb - 1)):
                return "mask"
        if not self.causal or kb - 1 <= qa:
            return "full"
        return "diag" if (qa, qb) == (ka, kb) else "mask"

    def plan(self, src: int):
        """Calls (q_lo, q_hi, k_ranges, diag, masked) in local rows, as _plan's plus the mask flag."""
        if src in self._plans:
            return self._plans[src]
        calls = []
        for qlo, qg, qn in self.ring.segs[self.ring.rank]:
            full: dict[tuple, list] = {}  # query range -> key ranges seen in full
            masked, mq = [], None
            for klo, kg, kn in self.ring.segs[src]:
                bounds = self._bounds(qg, qn, kg, kn)
                if bounds is None:
                    continue
                qa, qb, ka, kb = bounds
                rows, keys = (qlo + qa - qg, qlo + qb - qg), (klo + ka - kg, klo + kb - kg)
                kind = self._kind(*bounds)
                if kind == "full":
                    full.setdefault(rows, []).append(keys)
                elif kind == "diag":
                    calls.append((*rows, [keys], True, False))
                else:  # one masked call per query run, over the union of the rows
                    masked.append(keys)
                    mq = rows if mq is None else (min(mq[0], rows[0]), max(mq[1], rows[1]))
            calls += [(*rows, keys, False, False) for rows, keys in full.items()]
            if masked:
                calls.append((*mq, masked, False, True))
        self._plans[src] = calls
        return calls

    def mask(self, src: int, call) -> torch.Tensor:
        """(B, 1, q rows, keys) bool document mask of a masked call."""
        qlo, qhi, kr = call[:3]
        me = self.ring.rank
        dq, pq = self.doc[me][:, qlo:qhi], self.pos[me][qlo:qhi]
        if len(kr) == 1:
            dk, pk = self.doc[src][:, kr[0][0]:kr[0][1]], self.pos[src][kr[0][0]:kr[0][1]]
        else:
            dk = torch.cat([self.doc[src][:, lo:hi] for lo, hi in kr], 1)
            pk = torch.cat([self.pos[src][lo:hi] for lo, hi in kr])
        m = dq[:, :, None] == dk[:, None, :]
        if self.causal:
            m &= pk[None, None, :] <= pq[None, :, None]
        return m.unsqueeze(1)


def _cat_rows(x, ranges):
    if len(ranges) == 1:
        return x[:, :, ranges[0][0]:ranges[0][1]]
    return torch.cat([x[:, :, lo:hi] for lo, hi in ranges], dim=2)


def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _block_forward(q, k, v, diag, scale, cdt, mask=None):
    """(out, lse) of one block in the compute dtype. float64 goes through the reference so the
    lse stays float64 (the kernel's lse is fp32, which would cap the merged accuracy at ~1e-7).
    mask: None or bool (B, 1, Lq, Lk), True = may attend (packed rows)."""
    if cdt == torch.float64:
        out, lse = attention_reference(q, k, v, causal=diag, attn_mask=mask, scale=scale, dtype=torch.float64)
    else:
        out, lse = _kernel_attention(q, k, v, causal=diag, attn_mask=mask, return_lse=True, scale=scale)
    return out.to(cdt), lse.to(cdt)


def _merge_(acc_out, acc_lse, out, lse):
    """acc <- logsumexp-weighted merge of acc and a new partial, in place. Rows that are empty in
    both stay (0, -inf) instead of becoming NaN."""
    new = torch.logaddexp(acc_lse, lse)
    ref = new.masked_fill(torch.isinf(new), 0.0)
    acc_out.mul_(torch.exp(acc_lse - ref).unsqueeze(-1)).add_(out * torch.exp(lse - ref).unsqueeze(-1))
    acc_lse.copy_(new)


def _block_backward(q, k, v, dout, lse, delta, diag, scale, cdt, mask=None):
    """FlashAttention-style block gradients from the final lse: returns dq, dk, dv (GQA reduced).
    mask as in _block_forward; masked entries get P = exp(-inf - lse) = 0."""
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = hq // hkv
    qc, kc, vc, do = q.to(cdt), k.to(cdt), v.to(cdt), dout
    if g > 1:
        kc, vc = kc.repeat_interleave(g, dim=1), vc.repeat_interleave(g, dim=1)
    s = torch.matmul(qc, kc.transpose(-1, -2)) * scale
    if diag:  # lq == lk here
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    p = torch.exp(s - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, vc.transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, kc) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qc) * scale
    if g > 1:
        dk = dk.view(b, hkv, g, lk, d).sum(2)
        dv = dv.view(b, hkv, g, lk, d).sum(2)
    return dq, dk, dv


def _add_rows_(dst, src, ranges):
    off = 0
    for lo, hi in ranges:
        dst[:, :, lo:hi] += src[:, :, off:off + hi - lo]
        off += hi - lo


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, packed: "_Packed | None" = None):
        cdt = _compute_dtype(q.dtype)
        b, h, lq, d = q.shape
        out = torch.zeros(b, h, lq, d, dtype=cdt, device=q.device)
        lse = torch.full((b, h, lq), -math.inf, dtype=cdt, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            if step < ring.size - 1:  # post the next block's transfer before computing this one
                nxt = torch.empty_like(kv)
                reqs = _exchange(kv, nxt, ring, tag=0)
            for call in (ring.plan(src, lq) if packed is None else packed.plan(src)):
                qlo, qhi, kr, diag = call[:4]
                mask = packed.mask(src, call) if packed is not None and call[4] else None
                o, l = _block_forward(q[:, :, qlo:qhi], _cat_rows(kv[0], kr), _cat_rows(kv[1], kr),
                                      diag, ring.scale, cdt, mask)
                _merge_(out[:, :, qlo:qhi], lse[:, :, qlo:qhi], o, l)
            if step < ring.size - 1:
                _wait(reqs)
                kv = nxt
        out = out.to(q.dtype)
        ctx.ring, ctx.packed = ring, packed
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        ring, packed = ctx.ring, ctx.packed
        cdt = _compute_dtype(q.dtype)
        lq = q.shape[2]
        do = dout.to(cdt)
        delta = (do * out.to(cdt)).sum(-1)
        lse = lse.masked_fill(torch.isneginf(lse), math.inf)  # empty rows: P = exp(s - inf) = 0
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv_reqs = dkv_in = None
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            last = step == ring.size - 1
            if not last:
                nxt = torch.empty_like(kv)
                kv_reqs = _exchange(kv, nxt, ring, tag=0)
            dkv = torch.zeros((2,) + tuple(k.shape), dtype=cdt, device=k.device)
            for call in (ring.plan(src, lq) if packed is None else packed.plan(src)):
                qlo, qhi, kr, diag = call[:4]
                mask = packed.mask(src, call) if packed is not None and call[4] else None
                dq_i, dk_i, dv_i = _block_backward(
                    q[:, :, qlo:qhi], _cat_rows(kv[0], kr), _cat_rows(kv[1], kr), do[:, :, qlo:qhi],
                    lse[:, :, qlo:qhi], delta[:, :, qlo:qhi], diag, ring.scale, cdt, mask)
                dq[:, :, qlo:qhi] += dq_i
                _add_rows_(dkv[0], dk_i, kr)
                _add_rows_(dkv[1], dv_i, kr)
            if dkv_reqs is not None:  # the accumulator for this block from the previous rank
                _wait(dkv_reqs)
                dkv += dkv_in
            if ring.size > 1:
                # Pass this block's accumulator on; receive the one for the block held next step
                # (after the last step: our own block's complete gradient).
                dkv_in = torch.empty_like(dkv)
                dkv_reqs = _exchange(dkv, dkv_in, ring, tag=1)
            if not last:
                _wait(kv_reqs)
                kv = nxt
        if ring.size > 1:
            _wait(dkv_reqs)
            dkv = dkv_in
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None
