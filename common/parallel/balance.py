"""Even out per-item work (e.g. ViT image tiles) across the ranks of a data-parallel group.

With dynamic-resolution tiling every sample brings its own number of equally sized tiles, so with
plain data parallelism each rank encodes a different number of tiles and every step waits for the
rank with the most. `balanced_apply(fn, x, group)` moves items so that every rank runs `fn` on the
same number of them (the total split as evenly as possible: shares differ by at most one), then
sends the results back to the ranks that own the items:

    counts = all_gather(N_r)          ->  plan(counts): which (src, start, stop) slices each rank runs
    x --all_to_all (uneven splits)-->  share  --fn-->  y  --all_to_all (splits swapped)-->  out

Both exchanges are autograd functions (the adjoint of an all-to-all with splits is the all-to-all
with the splits swapped), so gradients w.r.t. x are exact and every item contributes to fn's
parameter gradients exactly once, on the rank that ran it: the sum of the parameter gradients over
the group equals the sum without balancing, which is what the DP gradient average (DDP all-reduce,
FSDP reduce-scatter) computes. Per-rank parameter gradients differ from the unbalanced ones; only
their sum is preserved, so call this on the whole DP group whose gradients are reduced together.

The plan (pure, deterministic, a function of the counts only):
- shares: total // D each, and the total % D extra items go to the ranks holding the most items
  (ties: lower rank), which keeps the most items at home;
- every rank keeps the first min(N_r, share_r) of its own items; the surplus items of the
  over-full ranks, taken in global order (rank, index), fill the under-full ranks in rank order.
  That moves the minimum number of items, sum(max(0, N_r - share_r)).
- a rank's share is ordered by global position (source rank, then index), so the batch fn sees is
  reproducible run to run for the same counts.

Contract for fn: it acts on each item independently along dim 0 (no batch statistics such as
BatchNorm in training mode, no cross-item attention), and returns a tensor whose dim 0 matches its
input and whose trailing shape and dtype are the same on every rank (the receiving side allocates
with the shape of its own fn output).

Empty shares: fn is *always* called, on every rank, also with a zero-size batch (a rank gets 0
items only when the group's total is below its size). Skipping it would be a hazard: under FSDP2
the forward all-gathers parameters and the backward reduce-scatters gradients inside fn, so every
rank must run the same collectives; under DDP a parameter with no gradient on one rank stalls or
errors the reducer. Calling fn on a zero-size tensor keeps fn's parameters in the autograd graph,
so backward reaches them and their gradient on that rank is zeros. A fn that cannot take a zero-size
batch (e.g. an op that rejects empty inputs) must be wrapped by the caller. If the whole group has
zero items, every rank returns fn(x) on its own empty x, again consistently.

Only dim 0 is exchanged; x may be any shape (tiles (N, C, H, W), patch tokens (N, L, C), ...).
Communication: gloo and nccl both support uneven `all_to_all_single` splits (checked on gloo,
including zero-size splits), so nothing is padded.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

Slice = tuple[int, int, int]  # (src_rank, start, stop): items [start, stop) of rank src_rank


# ----------------------------------------------------------------------------- pure planning
def shares(counts: list[int]) -> list[int]:
    """How many items each rank runs: total split as evenly as possible (max - min <= 1); the
    remainder goes to the ranks with the most items (ties to the lower rank)."""
    n = len(counts)
    if n == 0:
        return []
    if any(c < 0 for c in counts):
        raise ValueError(f"item counts must be >= 0, got {counts}")
    total = sum(counts)
    base, extra = divmod(total, n)
    out = [base] * n
    for r in sorted(range(n), key=lambda r: (-counts[r], r))[:extra]:
        out[r] += 1
    return out


def plan(counts: list[int]) -> list[list[Slice]]:
    """For each rank, the slices of items it runs, in global order (source rank, index).

    plan([7, 1]) == [[(0, 0, 4)], [(0, 4, 7), (1, 0, 1)]]
    Every item of every rank appears in exactly one slice; each rank's total is shares(counts)[r].
    """
    share = shares(counts)
    n = len(counts)
    keep = [min(c, s) for c, s in zip(counts, share)]
    # surplus items in global order, as (src, start, stop) runs
    surplus = [(r, keep[r], counts[r]) for r in range(n) if counts[r] > keep[r]]
    out: list[list[Slice]] = [[(r, 0, keep[r])] if keep[r] else [] for r in range(n)]
    si = 0
    for dst in range(n):
        need = share[dst] - keep[dst]
        while need > 0:
            src, start, stop = surplus[si]
            take = min(need, stop - start)
            out[dst].append((src, start, start + take))
            need -= take
            if start + take == stop:
                si += 1
            else:
                surplus[si] = (src, start + take, stop)
    for dst in range(n):
        out[dst].sort()
    return out


def imbalance(per_rank_work) -> float:
    """Slowest rank's work over the mean (1.0 = perfectly balanced; 1.0 when there is no work)."""
    work = [float(w) for w in per_rank_work]
    mean = sum(work) / len(work) if work else 0.0
    return max(work) / mean if mean > 0 else 1.0


def moved(counts: list[int]) -> int:
    """Items that leave their rank under plan(counts) (each also comes back as a result)."""
    return sum(stop - start for dst, sl in enumerate(plan(counts)) for src, start, stop in sl if src != dst)


def _rank_splits(p: list[list[Slice]], counts: list[int], rank: int):
    """This rank's view of the plan: send order (an index permutation of its items, or None when
    it is the identity), send sizes per destination, receive sizes per source."""
    n = len(counts)
    send_slices = [None] * n  # destination -> (start, stop) of this rank's items
    recv_sizes = [0] * n
    for dst in range(n):
        for src, start, stop in p[dst]:
            if src == rank:
                send_slices[dst] = (start, stop)
            if dst == rank:
                recv_sizes[src] = stop - start
    send_sizes = [0 if s is None else s[1] - s[0] for s in send_slices]
    order = [i for s in send_slices if s is not None for i in range(*s)]
    identity = order == list(range(counts[rank]))
    return (None if identity else order), send_sizes, recv_sizes


# ----------------------------------------------------------------------------- exchange
def _all_to_all_v(x: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv_sizes),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv_sizes, input_split_sizes=send_sizes,
                           group=group)
    return out


class _AllToAllV(torch.autograd.Function):
    """all_to_all_single with uneven splits along dim 0; its adjoint swaps the splits."""

    @staticmethod
    def forward(ctx, x, send_sizes, recv_sizes, group):
        ctx.args = (send_sizes, recv_sizes, group)
        return _all_to_all_v(x, send_sizes, recv_sizes, group)

    @staticmethod
    def backward(ctx, grad):
        send_sizes, recv_sizes, group = ctx.args
        # Every rank runs this backward (each rank's forward ran it), so the collective matches.
        return _all_to_all_v(grad, recv_sizes, send_sizes, group), None, None, None


def balanced_apply(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, group=None) -> torch.Tensor:
    """fn(x) row by row, with the rows of all ranks of `group` spread evenly over the ranks.

    x: (N_local, ...) on each rank, N_local may differ between ranks and may be 0. Returns
    (N_local, ...out): row i is fn applied to row i of x, computed on whichever rank the plan put it.
    Collective: every rank of `group` must call it (in the same order as other collectives).
    group None with no initialised process group, or a group of size 1: plain fn(x).
    """
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return fn(x)
    n = dist.get_world_size(group)
    if n == 1:
        return fn(x)
    rank = dist.get_rank(group)
    local = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
    gathered = [torch.empty_like(local) for _ in range(n)]
    dist.all_gather(gathered, local, group=group)
    counts = [int(c.item()) for c in gathered]
    if sum(counts) == 0:
        return fn(x)  # every rank takes this branch: fn still runs (on an empty batch) everywhere
    order, send_sizes, recv_sizes = _rank_splits(plan(counts), counts, rank)
    if order is not None:
        x = x.index_select(0, torch.tensor(order, dtype=torch.long, device=x.device))
    share = _AllToAllV.apply(x, send_sizes, recv_sizes, group)
    y = fn(share)
    if y.shape[0] != share.shape[0]:
        raise ValueError(f"fn must keep dim 0: got {tuple(y.shape)} for an input of {tuple(share.shape)}")
    out = _AllToAllV.apply(y, recv_sizes, send_sizes, group)
    if order is not None:  # results arrive in send order; put them back in item order
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
        out = out.index_select(0, inverse.to(out.device))
    return out
