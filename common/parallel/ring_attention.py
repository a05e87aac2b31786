"""Ring attention: the K/V blocks of a sequence-sharded attention travel round the CP ring.

Used by common.parallel.context_parallel (ring and hybrid modes). Forward: partial outputs of
each block are merged by log-sum-exp, the next block's transfer posted before the current
block is computed. Backward: FlashAttention-style block gradients from the final LSE, K/V sent
round again together with their dK/dV accumulators, so no rank ever holds the full K/V.
Causal attention is planned per block pair from global positions (zig-zag or contiguous shards).
"""
from __future__ import annotations

import math

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
        self.segs = [_truncate(s, seq_len) for s in segs_per_participant]
        self.causal, self.scale = causal, scale
        self._plans = {}

    def plan(self, src: int, q_rows: int):
        if src not in self._plans:
            self._plans[src] = _plan(self.segs[self.rank], self.segs[src], self.causal, q_rows)
        return self._plans[src]


def _cat_rows(x, ranges):
    if len(ranges) == 1:
        return x[:, :, ranges[0][0]:ranges[0][1]]
    return torch.cat([x[:, :, lo:hi] for lo, hi in ranges], dim=2)


def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _block_forward(q, k, v, diag, scale, cdt):
    """(out, lse) of one block in the compute dtype. float64 goes through the reference so the
    lse stays float64 (the kernel's lse is fp32, which would cap the merged accuracy at ~1e-7)."""
    if cdt == torch.float64:
        out, lse = attention_reference(q, k, v, causal=diag, scale=scale, dtype=torch.float64)
    else:
        out, lse = _kernel_attention(q, k, v, causal=diag, return_lse=True, scale=scale)
    return out.to(cdt), lse.to(cdt)


def _merge_(acc_out, acc_lse, out, lse):
    """acc <- logsumexp-weighted merge of acc and a new partial, in place. Rows that are empty in
    both stay (0, -inf) instead of becoming NaN."""
    new = torch.logaddexp(acc_lse, lse)
    ref = new.masked_fill(torch.isinf(new), 0.0)
    acc_out.mul_(torch.exp(acc_lse - ref).unsqueeze(-1)).add_(out * torch.exp(lse - ref).unsqueeze(-1))
    acc_lse.copy_(new)


def _block_backward(q, k, v, dout, lse, delta, diag, scale, cdt):
    """FlashAttention-style block gradients from the final lse: returns dq, dk, dv (GQA reduced)."""
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = hq // hkv
    qc, kc, vc, do = q.to(cdt), k.to(cdt), v.to(cdt), dout
    if g > 1:
        kc, vc = kc.repeat_interleave(g, dim=1), vc.repeat_interleave(g, dim=1)
    s = torch.matmul(qc, kc.transpose(-1, -2)) * scale
    if diag:  # lq == lk here
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(1), -math.inf)
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
    def forward(ctx, q, k, v, ring: _Ring):
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
            for qlo, qhi, kr, diag in ring.plan(src, lq):
                o, l = _block_forward(q[:, :, qlo:qhi], _cat_rows(kv[0], kr), _cat_rows(kv[1], kr),
                                      diag, ring.scale, cdt)
                _merge_(out[:, :, qlo:qhi], lse[:, :, qlo:qhi], o, l)
            if step < ring.size - 1:
                _wait(reqs)
                kv = nxt
        out = out.to(q.dtype)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
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
            for qlo, qhi, kr, diag in ring.plan(src, lq):
                dq_i, dk_i, dv_i = _block_backward(
                    q[:, :, qlo:qhi], _cat_rows(kv[0], kr), _cat_rows(kv[1], kr), do[:, :, qlo:qhi],
                    lse[:, :, qlo:qhi], delta[:, :, qlo:qhi], diag, ring.scale, cdt)
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
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None
