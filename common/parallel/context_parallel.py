"""Context parallelism: softmax attention over a sequence sharded across the CP ranks.

    cp = ContextParallel(mesh["cp"], mode="ring", layout="zigzag")
    cp.validate(num_heads, num_kv_heads, seq_len)     # fail at start, naming the numbers
    x = cp.shard(tokens, dim=1)                        # (B, L_local, C) on every CP rank
    block.attn.attn_impl = cp.attention                # q, k, v arrive as (B, H, L_local, D)
    out = cp.gather(x, dim=1)                          # (B, L, C), natural order

Modes (their product is the CP degree N = ulysses_degree x ring_degree):
  ulysses  all-to-all turns (sequence-sharded, all heads) into (full sequence, heads/N), runs the
           local kernel, and turns it back. Two all-to-alls per call; needs heads % N == 0.
  ring     K/V blocks travel round the ring (point-to-point, the next transfer posted before the
           current block is computed); partial outputs are merged by log-sum-exp. The backward
           sends K/V together with their dK/dV accumulators, so no rank ever holds the full K/V.
  hybrid   Ulysses inside the inner group, ring across the outer one: fewer ring steps than pure
           ring, fewer heads needed than pure Ulysses.

Layouts: "contiguous" (rank r holds tokens [r*L/N, (r+1)*L/N)) or "zigzag" (the sequence cut into
2N chunks, rank r holding chunks r and 2N-1-r), which gives every rank the same causal work.

Uneven lengths are padded, exactly: a sequence is padded at its end to a multiple of N (2N for
zigzag) before sharding; padded keys are never attended to, padded query rows give zeros, and
`gather` drops them, so values and gradients equal the unpadded computation. Layers between
shard and gather see the padded tokens as extra rows: that is exact for token-wise layers and
CP attention, not for a layer that pools over the sequence. The true length is recorded by
`shard` (or given as `seq_len=` to attention/gather).

Packed rows (varlen): `attention(q, k, v, causal=True, cu_seqlens=cu, max_seqlen=m)` with cu the
(S + 1,) int32 offsets of the documents over the flattened *unsharded* B x L tokens (the same
tensor on every CP rank; every token in one document, none crossing a row boundary, a row's
padding tail its own document) computes kernels.attention's varlen attention on the gathered
rows: a token sees only its own document (causally, or all of it when causal=False). Ulysses
reorders its full rows to natural order, drops the CP padding and runs the varlen kernel;
ring/hybrid give every block pair a document plan (common.parallel.ring_attention._Packed:
pairs that cannot meet are skipped, blocks inside one document stay unmasked, the rest get a
document mask by global position, so zigzag chunks need nothing special). cu_seqlens is
checked (ValueError) and turned into document ids once per tensor: the geometry is cached by
the tensor's identity, so the layers of one step share it and pay one host sync in all.
On CUDA the masked ring blocks run the reference math (the Triton kernel takes no mask).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from common.kernels import attention as _kernel_attention
from common.parallel.ring_attention import _merge_adjacent, _Packed, _Ring, _RingAttention

MODES = ("ulysses", "ring", "hybrid")
LAYOUTS = ("contiguous", "zigzag")


# ----------------------------------------------------------------------------- collectives
def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split x into n pieces along scatter_dim, send piece i to group rank i, and concatenate
    what arrives along gather_dim in source-rank order."""
    n = dist.get_world_size(group)
    inp = torch.stack(x.chunk(n, scatter_dim)).contiguous()
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp, group=group)
    return torch.cat(out.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    # The adjoint of an all-to-all is the all-to-all with the two dims swapped.
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.args = (group, scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        group, scatter_dim, gather_dim = ctx.args
        return _all_to_all(grad.contiguous(), group, gather_dim, scatter_dim), None, None, None


# ----------------------------------------------------------------------------- shard / gather
class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp, dim, seq_len):
        ctx.args = (cp, dim)
        return cp._gather_natural(x, dim, seq_len)

    @staticmethod
    def backward(ctx, grad):
        cp, dim = ctx.args
        # The caller's post-gather computation is replicated on every CP rank and parameter grads
        # are averaged over CP: scaling by N makes that average the true gradient.
        return cp._shard_raw(grad, dim) * cp.size, None, None, None


class ContextParallel:
    """Sequence-sharded attention over the CP process group(s).

    mesh: a 1-D DeviceMesh (the "cp" dim) for ulysses, ring or hybrid, or a 2-D DeviceMesh with
      dims ("cp_ring", "cp_ulysses") (Ulysses innermost) for hybrid; None means no CP (size 1).
      For hybrid on a 1-D mesh, `ulysses_degree` is required and the two sub-groups are carved
      out of the mesh (DeviceMesh._unflatten; every CP rank must construct the object, since that
      creates process groups). CP rank r = ring_rank * ulysses_degree + ulysses_rank.
    mode: "ulysses" | "ring" | "hybrid". layout: "contiguous" | "zigzag".

    attention() refuses attn_mask; RoPE/position tables must be sharded like the tokens
    (`shard(table, 0)` or index them with `positions(seq_len)`).
    """

    def __init__(self, mesh: DeviceMesh | None, mode: str = "ring", *, layout: str = "contiguous",
                 ulysses_degree: int | None = None):
        if mode not in MODES:
            raise ValueError(f"context parallel mode {mode!r} is not one of {MODES}")
        if layout not in LAYOUTS:
            raise ValueError(f"context parallel layout {layout!r} is not one of {LAYOUTS}")
        self.mode, self.layout, self.mesh = mode, layout, mesh
        self.seq_len: int | None = None  # true global length, recorded by shard()
        self._rings: dict = {}  # geometry caches: rings and Ulysses row orders
        self._packs: dict = {}  # packed-row geometry: key -> (cu_seqlens, its version, value)
        if mesh is None:
            self.size, self.rank, self.ulysses_degree, self.ring_degree = 1, 0, 1, 1
            self._ulysses_group = self._ring_group = None
            self._gather_groups = []
            return
        if mesh.ndim == 2:
            names = mesh.mesh_dim_names or ("cp_ring", "cp_ulysses")
            if mode != "hybrid":
                raise ValueError(f"a 2-D CP mesh {tuple(names)} means mode='hybrid', got {mode!r}")
            ring_mesh, uly_mesh = mesh[names[0]], mesh[names[1]]
            if ulysses_degree is not None and ulysses_degree != uly_mesh.size():
                raise ValueError(f"ulysses_degree={ulysses_degree} contradicts the mesh's "
                                 f"{names[1]} size {uly_mesh.size()}")
        elif mesh.ndim == 1:
            n = mesh.size()
            if mode == "hybrid":
                if not ulysses_degree or n % ulysses_degree:
                    raise ValueError(f"parallel.cp={n}: hybrid mode needs a ulysses_degree dividing {n}, "
                                     f"got {ulysses_degree}")
                sub = mesh._unflatten(0, (n // ulysses_degree, ulysses_degree), ("cp_ring", "cp_ulysses"))
                ring_mesh, uly_mesh = sub["cp_ring"], sub["cp_ulysses"]
            else:
                if ulysses_degree not in (None, n if mode == "ulysses" else 1):
                    raise ValueError(f"mode={mode!r} on parallel.cp={n} contradicts "
                                     f"ulysses_degree={ulysses_degree}")
                ring_mesh = mesh if mode == "ring" else None
                uly_mesh = mesh if mode == "ulysses" else None
        else:
            raise ValueError(f"context parallel needs a 1-D or 2-D DeviceMesh, got {mesh.ndim}-D")
        self._ulysses_group = uly_mesh.get_group() if uly_mesh is not None else None
        self._ring_group = ring_mesh.get_group() if ring_mesh is not None else None
        self.ulysses_degree = uly_mesh.size() if uly_mesh is not None else 1
        self.ring_degree = ring_mesh.size() if ring_mesh is not None else 1
        self.size = self.ulysses_degree * self.ring_degree
        ur = dist.get_rank(self._ulysses_group) if uly_mesh is not None else 0
        rr = dist.get_rank(self._ring_group) if ring_mesh is not None else 0
        self.rank = rr * self.ulysses_degree + ur
        # all-gather inner group first so the concatenation comes out in CP-rank order
        self._gather_groups = [g for g in (self._ulysses_group, self._ring_group) if g is not None]

    # ------------------------------------------------------------------ geometry
    def _describe(self) -> str:
        return f"parallel.cp={self.size} (ulysses {self.ulysses_degree} x ring {self.ring_degree})"

    @property
    def num_chunks(self) -> int:
        return 2 * self.size if self.layout == "zigzag" else self.size

    def padded_len(self, seq_len: int) -> int:
        """seq_len rounded up to a multiple of N (2N for zigzag)."""
        m = self.num_chunks
        return -(-seq_len // m) * m

    def _chunk_ids(self, cp_rank: int) -> list[int]:
        if self.layout == "zigzag":
            return [cp_rank, 2 * self.size - 1 - cp_rank]
        return [cp_rank]

    def _segments(self, cp_rank: int, chunk: int):
        return [(i * chunk, c * chunk, chunk) for i, c in enumerate(self._chunk_ids(cp_rank))]

    def positions(self, seq_len: int, device=None) -> torch.Tensor:
        """Global token indices (long) of this rank's shard of a length-seq_len sequence, in
        local order. Indices >= seq_len are padding rows (clamp them for table lookups)."""
        c = self.padded_len(seq_len) // self.num_chunks
        ids = self._chunk_ids(self.rank)
        return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in ids])

    def validate(self, num_heads: int, num_kv_heads: int, seq_len: int) -> None:
        """Raise ValueError, naming the numbers, if these shapes cannot run under this CP layout.
        Sequence lengths that do not divide are accepted (padded, see the module doc); kv heads
        that do not divide by the Ulysses degree are replicated (their gradients summed back)."""
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"{self._describe()}: {num_heads} query heads are not a multiple of "
                             f"{num_kv_heads} kv heads")
        if num_heads % self.ulysses_degree:
            raise ValueError(f"{self._describe()}: {num_heads} heads are not divisible by the Ulysses "
                             f"degree {self.ulysses_degree}; use a Ulysses degree dividing {num_heads} "
                             f"or more ring parallelism")
        if seq_len < 1:
            raise ValueError(f"{self._describe()}: sequence length {seq_len} must be positive")

    # ------------------------------------------------------------------ shard / gather
    def _shard_raw(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        n = x.shape[dim]
        lp = self.padded_len(n)
        if lp != n:
            pad = list(x.shape)
            pad[dim] = lp - n
            x = torch.cat([x, x.new_zeros(pad)], dim)
        c = lp // self.num_chunks
        parts = [x.narrow(dim, i * c, c) for i in self._chunk_ids(self.rank)]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim)).contiguous()

    def shard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's part of x (identical on all CP ranks) along dim, padded to padded_len.
        Records the true length for attention/gather. Backward: plain slicing (the gradient is
        the local part, zeros elsewhere)."""
        if self.size == 1:
            return x
        self.seq_len = x.shape[dim]
        return self._shard_raw(x, dim)

    def _gather_natural(self, x: torch.Tensor, dim: int, seq_len: int) -> torch.Tensor:
        x = x.contiguous()
        for group in self._gather_groups:
            bufs = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
            dist.all_gather(bufs, x, group=group)
            x = torch.cat(bufs, dim)
        if self.layout == "zigzag":  # rank r's shard is chunks (r, 2N-1-r): put them back in place
            n = self.size
            chunks = [None] * (2 * n)
            for r, piece in enumerate(x.chunk(n, dim)):
                chunks[r], chunks[2 * n - 1 - r] = piece.chunk(2, dim)
            x = torch.cat(chunks, dim)
        return x.narrow(dim, 0, seq_len)

    def gather(self, x: torch.Tensor, dim: int, seq_len: int | None = None) -> torch.Tensor:
        """All-gather the local shards into the full tensor in natural order, padding dropped.

        Backward: the local slice of the incoming gradient multiplied by the CP size N. This is
        the right gradient when the computation after the gather is replicated identically on
        every CP rank and parameter gradients are then AVERAGED over the CP group (as the
        data-parallel reduction over dp x cp does): each rank's pre-gather parameters only see
        their own shard's contribution, and the x N turns the average of those into the sum."""
        if self.size == 1:
            return x
        seq_len = self._seq_len(x.shape[dim], seq_len)
        return _Gather.apply(x, self, dim, seq_len)

    def _seq_len(self, local_len: int, seq_len: int | None) -> int:
        lp = local_len * self.size
        seq_len = seq_len if seq_len is not None else (self.seq_len if self.seq_len is not None else lp)
        if self.padded_len(seq_len) != lp:
            raise ValueError(f"{self._describe()}: local length {local_len} x {self.size} ranks = {lp} "
                             f"is not the padded length {self.padded_len(seq_len)} of sequence length "
                             f"{seq_len}; shard the sequence with this object or pass seq_len=")
        return seq_len

    # ------------------------------------------------------------------ attention
    def attention(self, q, k, v, *, causal: bool = False, attn_mask=None, return_lse: bool = False,
                  scale: float | None = None, seq_len: int | None = None,
                  cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None, **unused):
        """kernels.attention over sequence-sharded q (B, Hq, L_local, D), k/v (B, Hkv, L_local, D).
        Returns out (B, Hq, L_local, D), or (out, lse) with lse (B, Hq, L_local) fp32 (not
        differentiable under ring/hybrid). Padded query rows give zeros.
        cu_seqlens: packed rows (see the module doc), offsets over the unsharded B x seq_len
        tokens; max_seqlen (the longest document) is passed on to the varlen kernel."""
        if attn_mask is not None:
            raise ValueError(f"{self._describe()}: attn_mask is not supported under context parallelism "
                             "(the mask would have to be sharded like the keys); use causal= or no mask")
        if self.size == 1:
            if cu_seqlens is not None:
                self._packed_rows(cu_seqlens, q.shape[0], q.shape[2])
                return self._varlen(q, k, v, causal, scale, cu_seqlens, max_seqlen, return_lse)
            return _kernel_attention(q, k, v, causal=causal, return_lse=return_lse, scale=scale)
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
        seq_len = self._seq_len(q.shape[2], seq_len)
        self.validate(hq, hkv, seq_len)
        scale = d ** -0.5 if scale is None else scale
        if cu_seqlens is not None:
            self._packed_rows(cu_seqlens, q.shape[0], seq_len)  # ValueError before any collective
        if self.mode == "ulysses":
            out, lse = self._ulysses(q, k, v, causal, scale, seq_len, return_lse, cu_seqlens, max_seqlen)
        else:
            if self._ulysses_group is not None:
                q, k, v = self._to_heads(q, k, v)
            ring = self._ring(q.shape[2] // self.ulysses_degree, seq_len, causal, scale)
            packed = (None if cu_seqlens is None else
                      self._packed(ring, cu_seqlens, q.shape[0], seq_len, causal, q.device))
            out, lse = _RingAttention.apply(q, k, v, ring, packed)
            if self._ulysses_group is not None:
                out = _AllToAll.apply(out, self._ulysses_group, 2, 1)
                if return_lse:
                    lse = _all_to_all(lse.unsqueeze(-1).contiguous(), self._ulysses_group, 2, 1).squeeze(-1)
        return (out, lse.float()) if return_lse else out

    # ------------------------------------------------------------------ packed rows
    def _cached(self, key, cu: torch.Tensor, build):
        """build() once per cu_seqlens tensor (by identity and version) and geometry key. The
        entry holds the tensor, so its storage cannot be reused by another batch's offsets.
        Inference-mode tensors track no version: rebuilt on every call."""
        version = None if cu.is_inference() else cu._version  # inference tensors keep no version
        hit = self._packs.get(key)
        if hit is not None and hit[0] is cu and version is not None and hit[1] == version:
            return hit[2]
        value = build()
        self._packs[key] = (cu, version, value)
        return value

    def _packed_rows(self, cu: torch.Tensor, batch: int, seq_len: int) -> list[list[int]]:
        """Validate cu_seqlens against B x seq_len rows; per row, the row-local document starts
        with seq_len appended (one host sync per new tensor)."""
        def build():
            total = batch * seq_len
            if cu.dim() != 1 or cu.numel() < 2 or cu.dtype.is_floating_point:
                raise ValueError(f"{self._describe()}: cu_seqlens must be a 1-D integer tensor of S + 1 >= 2 "
                                 f"offsets, got shape {tuple(cu.shape)} {cu.dtype}")
            c = cu.tolist()
            if c[0] != 0 or c[-1] != total or any(x > y for x, y in zip(c, c[1:])):
                raise ValueError(f"{self._describe()}: cu_seqlens must rise from 0 to the {batch} x {seq_len} "
                                 f"= {total} tokens of the unsharded rows; got {len(c)} offsets from {c[0]} "
                                 f"to {c[-1]}")
            bounds = set(c)
            for r in range(1, batch):
                if r * seq_len not in bounds:
                    i = next(i for i, x in enumerate(c) if x > r * seq_len)
                    raise ValueError(f"{self._describe()}: cu_seqlens segment {i - 1} [{c[i - 1]}, {c[i]}) "
                                     f"crosses the boundary of rows {r - 1} and {r} at token {r * seq_len} "
                                     f"(rows of length {seq_len}); packed segments must stay inside a row")
            return [sorted({x - r * seq_len for x in c if r * seq_len <= x < (r + 1) * seq_len}) + [seq_len]
                    for r in range(batch)]
        return self._cached(("rows", batch, seq_len), cu, build)

    def _packed(self, ring: _Ring, cu, batch: int, seq_len: int, causal: bool, device) -> _Packed:
        """The ring's document plan for these rows; document ids live on `device` (q's)."""
        def build():
            starts = self._packed_rows(cu, batch, seq_len)
            lp = self.padded_len(seq_len)
            tok = torch.arange(batch * seq_len, device=device)
            doc = (torch.searchsorted(cu.to(device, torch.long), tok, right=True) - 1).view(batch, seq_len)
            if lp != seq_len:
                doc = torch.cat([doc, doc.new_full((batch, lp - seq_len), -1)], 1)
            return _Packed(ring, starts, doc, causal)
        return self._cached(("ring", id(ring), batch, seq_len, causal, str(device)), cu, build)

    @staticmethod
    def _varlen(q, k, v, causal, scale, cu, max_seqlen, return_lse):
        """The varlen kernel on full rows (B, H, L, D) in natural order, unpadded."""
        b, h, n, d = q.shape
        flat = [t.transpose(1, 2).reshape(b * n, t.shape[1], d) for t in (q, k, v)]
        res = _kernel_attention(*flat, causal=causal, return_lse=return_lse, scale=scale, cu_seqlens_q=cu,
                                cu_seqlens_k=cu, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)
        out, lse = res if return_lse else (res, None)
        out = out.view(b, n, h, d).transpose(1, 2)
        if lse is not None:
            lse = lse.view(h, b, n).transpose(0, 1)
            return out, lse
        return out

    def _to_heads(self, q, k, v):
        """Ulysses all-to-all: (all heads, local tokens) -> (heads/U, the U shards' tokens). kv heads
        that do not divide by U are replicated up to lcm(Hkv, U), which keeps query head h reading
        kv head h // (Hq/Hkv); autograd sums the replicas' gradients."""
        u, hkv = self.ulysses_degree, k.shape[1]
        if hkv % u:
            r = u // math.gcd(hkv, u)
            k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
        g = self._ulysses_group
        return (_AllToAll.apply(q.contiguous(), g, 1, 2), _AllToAll.apply(k.contiguous(), g, 1, 2),
                _AllToAll.apply(v.contiguous(), g, 1, 2))

    def _ulysses(self, q, k, v, causal, scale, seq_len, return_lse, cu=None, max_seqlen=None):
        q, k, v = self._to_heads(q, k, v)
        lp = q.shape[2]
        # packed rows need natural order even without causality: documents are position ranges
        keep = self._ulysses_keep(lp, seq_len, causal or cu is not None, q.device)
        if keep is not None:
            q, k, v = (t.index_select(2, keep) for t in (q, k, v))
        if cu is not None:
            res = self._varlen(q, k, v, causal, scale, cu, max_seqlen, return_lse)
        else:
            res = _kernel_attention(q, k, v, causal=causal, return_lse=return_lse, scale=scale)
        out, lse = res if return_lse else (res, None)
        if keep is not None:  # back to the gathered order; padded query rows get out 0, lse -inf
            shape = out.shape[:2] + (lp,) + out.shape[3:]
            out = out.new_zeros(shape).index_copy(2, keep, out)
            if lse is not None:
                lse = lse.new_full(shape[:3], -math.inf).index_copy(2, keep, lse)
        out = _AllToAll.apply(out, self._ulysses_group, 2, 1)
        if lse is not None:
            lse = _AllToAll.apply(lse.unsqueeze(-1).contiguous(), self._ulysses_group, 2, 1).squeeze(-1)
        return out, lse

    def _ulysses_keep(self, lp: int, seq_len: int, causal: bool, device):
        """Rows of the gathered sequence (the ranks' shards, one after another) the local kernel
        sees, in natural order with the padding dropped; None when they can be used as they are."""
        if lp == seq_len and (self.layout == "contiguous" or not causal):
            return None  # already natural, or order irrelevant without causality; nothing padded
        key = (lp, seq_len, str(device))
        if key not in self._rings:
            c = lp // self.num_chunks
            pos = torch.cat([torch.arange(i * c, (i + 1) * c) for r in range(self.size)
                             for i in self._chunk_ids(r)])
            self._rings[key] = torch.argsort(pos)[:seq_len].to(device)
        return self._rings[key]

    def _ring(self, shard_len: int, seq_len: int, causal: bool, scale: float) -> _Ring:
        """The ring for this geometry; participant j holds the U shards of CP ranks j*U + u."""
        key = (shard_len, seq_len, causal, scale)
        if key not in self._rings:
            u = self.ulysses_degree
            chunk = shard_len // len(self._chunk_ids(0))
            segs = []
            for j in range(self.ring_degree):
                s = []
                for i in range(u):
                    s += [(i * shard_len + lo, g, n) for lo, g, n in self._segments(j * u + i, chunk)]
                segs.append(_merge_adjacent(s))
            self._rings[key] = _Ring(self._ring_group, segs, seq_len, causal, scale)
        return self._rings[key]
