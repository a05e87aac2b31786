"""LM-head matmul + cross-entropy without materialising the (tokens x vocab) logits.

At 16k tokens x 128k vocab, eager `F.cross_entropy(hidden @ weight.T, targets)` holds 4 GiB of bf16
logits, 4 GiB of log-softmax saved for backward and 8 GiB more of gradients during backward.
Here the vocabulary is walked in slices of `chunk_size` rows of `weight`:
  forward   logits_c = hidden @ weight[c].T (T, Vc); a running max and sum of exponentials over
            slices and the target logit are all that is kept: (T,) vectors.
  backward  recompute logits_c, turn them into d logits_c = (softmax - onehot) * g in place, then
            d weight[c] = d logits_c.T @ hidden (written once, in the weight's dtype: no fp32
            (V, D) accumulator) and d hidden += d logits_c @ weight[c] (fp32 (T, D) accumulator).
Saved for backward: hidden, weight, targets, max and log-sum (T,) each. Cost: one extra logits matmul (the
recompute), i.e. 4 instead of 3 (T x D x V) matmuls; the memory is what it buys.
Slicing the vocabulary (not the tokens) is what lets d weight be written without accumulation;
tokens stay whole, so the slice width shrinks as tokens grow (see _default_chunk).

Backends: "torch" (torch ops per slice), "triton" (the per-slice softmax passes of
common/kernels/triton/cross_entropy.py, which never upcast a slice to fp32), "reference" (eager,
for comparison and FLOP counting; also `cross_entropy_eager`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import dispatch_device, resolve_backend, unserved

REDUCTIONS = ("mean", "sum", "none")
_CHUNK_ELEMENTS = 1 << 26  # logits elements per slice: 128 MiB in bf16, 256 MiB for the fp32 torch temps


def _default_chunk(tokens: int, vocab: int) -> int:
    """Vocabulary rows per slice: about _CHUNK_ELEMENTS logits, a multiple of 256 (matmul tiles),
    at least 256 so the matmuls stay efficient when tokens are many."""
    per = max(256, (_CHUNK_ELEMENTS // max(tokens, 1)) // 256 * 256)
    return min(per, vocab)


class TorchChunkOps:
    """Per-slice forward/grad in torch ops (fp32 temporaries of one slice; fp64 stays fp64).

    The softmax state per token is (m, s): the running max logit and the sum of exp(x - m) over
    the slices seen, not lse = m + log(s): the backward then forms p = exp((x - m) - log s),
    where x - m is nearly exact and log s is small, as log_softmax does, rather than x - lse
    with lse rounded at the logits' magnitude (about 2x the error in the gradients)."""

    @staticmethod
    def _target_in(targets, v0, n, ignore_index):
        local = targets - v0
        inside = (local >= 0) & (local < n) & (targets != ignore_index)
        return local.clamp(0, n - 1), inside

    def forward_chunk(self, logits, targets, v0, m, s, xt, ignore_index):
        lf = logits.to(m.dtype)
        cm = lf.amax(dim=-1)
        cs = torch.exp(lf - cm[:, None]).sum(dim=-1)
        m_new = torch.maximum(m, cm)
        s.copy_(s * torch.exp(m - m_new) + cs * torch.exp(cm - m_new))  # m = -inf at first: s * 0
        m.copy_(m_new)
        idx, inside = self._target_in(targets, v0, lf.shape[1], ignore_index)
        picked = lf.gather(1, idx[:, None]).squeeze(1)
        xt.add_(torch.where(inside, picked, torch.zeros_like(picked)))  # no host sync (no nonzero)

    def grad_chunk(self, logits, targets, v0, m, log_s, g, ignore_index):
        lf = logits.to(m.dtype)  # the same buffer when already fp32: we own it, so in place is fine
        lf.sub_(m[:, None]).sub_(log_s[:, None]).exp_().mul_(g[:, None])
        idx, inside = self._target_in(targets, v0, lf.shape[1], ignore_index)
        lf.scatter_add_(1, idx[:, None], torch.where(inside, -g, torch.zeros_like(g))[:, None])
        return lf.to(logits.dtype)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """hidden (T, D), weight (V, D), targets (T,) int64 -> per reduction; `ops` does the per-slice
    softmax work (TorchChunkOps or the Triton TritonChunkOps)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index: int, chunk: int, reduction: str, ops):
        t, v = hidden.shape[0], weight.shape[0]
        cdt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        m = torch.full((t,), float("-inf"), dtype=cdt, device=hidden.device)
        s = torch.zeros(t, dtype=cdt, device=hidden.device)
        xt = torch.zeros(t, dtype=cdt, device=hidden.device)
        for v0 in range(0, v, chunk):
            logits = hidden @ weight[v0:v0 + chunk].to(hidden.dtype).T
            ops.forward_chunk(logits, targets, v0, m, s, xt, ignore_index)
            del logits
        log_s = s.log_()
        valid = targets != ignore_index
        loss = torch.where(valid, (m - xt) + log_s, torch.zeros_like(m))  # lse - x_t, small terms first
        n_valid = valid.sum()
        ctx.save_for_backward(hidden, weight, targets, m, log_s, n_valid)
        ctx.ignore_index, ctx.chunk, ctx.reduction, ctx.ops = ignore_index, chunk, reduction, ops
        if reduction == "mean":
            return loss.sum() / n_valid  # all targets ignored -> nan, as F.cross_entropy
        return loss.sum() if reduction == "sum" else loss

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, m, log_s, n_valid = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        t, v = hidden.shape[0], weight.shape[0]
        valid = targets != ctx.ignore_index
        g = grad_out.to(m.dtype)
        if ctx.reduction == "mean":
            g = g / n_valid.clamp_min(1)
        g = torch.where(valid, g.expand(t), torch.zeros_like(m))  # per-token dloss/dloss_t
        single = v <= ctx.chunk
        dh = None
        if need_h and not single:
            dh = torch.zeros(hidden.shape, dtype=m.dtype, device=hidden.device)
        dw = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if need_w else None
        for v0 in range(0, v, ctx.chunk):
            w = weight[v0:v0 + ctx.chunk].to(hidden.dtype)
            logits = hidden @ w.T
            dl = ctx.ops.grad_chunk(logits, targets, v0, m, log_s, g, ctx.ignore_index)
            del logits
            if need_w:
                if dw.dtype == dl.dtype:
                    torch.mm(dl.T, hidden, out=dw[v0:v0 + ctx.chunk])  # rows of dw: contiguous slice
                else:
                    dw[v0:v0 + ctx.chunk] = dl.T @ hidden
            if need_h:
                if single:
                    dh = dl @ w
                elif dh.dtype == dl.dtype:
                    dh.addmm_(dl, w)
                else:
                    dh += dl @ w  # 16-bit partial, fp32 sum: one rounding per slice, not per add
        if need_h:
            dh = dh.to(hidden.dtype)
        return dh, dw, None, None, None, None, None


def cross_entropy_eager(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                        ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """The unchunked baseline: full logits, then F.cross_entropy."""
    return F.cross_entropy(hidden @ weight.T, targets, ignore_index=ignore_index, reduction=reduction)


def cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                  ignore_index: int = -100, chunk_size: int | None = None, reduction: str = "mean",
                  backend: str | None = None) -> torch.Tensor:
    """Cross-entropy of logits = hidden @ weight.T against targets, computed per vocabulary slice.

    hidden (..., D), weight (V, D) (an LM head without bias), targets (...) int with values in
    [0, V) or ignore_index (not range-checked: that would cost a host sync). chunk_size:
    vocabulary rows per slice (None: ~64M logits per slice). reduction "mean" (over non-ignored
    targets; nan when all are ignored, as F.cross_entropy), "sum" or "none" (per token, 0 where
    ignored, shaped like targets). The loss is fp32 for 16-bit inputs (fp64 for fp64).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"hidden (..., {hidden.shape[-1]}) does not match weight {tuple(weight.shape)}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"targets {tuple(targets.shape)} do not match hidden {tuple(hidden.shape)}")
    impl = resolve_backend(backend, op="cross_entropy", device=dispatch_device(hidden, weight, targets))
    h2, t1 = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if impl == "reference":
        loss = cross_entropy_eager(h2, weight, t1, ignore_index=ignore_index, reduction=reduction)
        return loss.view(targets.shape) if reduction == "none" else loss
    chunk = chunk_size or _default_chunk(h2.shape[0], weight.shape[0])
    if chunk < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    ops = TorchChunkOps()
    if impl == "triton":
        from .triton import cross_entropy as tce  # lazy: triton is imported only when used
        if tce.supports(h2, weight):
            ops = tce.TritonChunkOps()
        else:
            unserved("cross_entropy", backend, tce.SUPPORTED)
    loss = ChunkedLinearCrossEntropy.apply(h2, weight, t1.long(), ignore_index, chunk, reduction, ops)
    return loss.view(targets.shape) if reduction == "none" else loss
