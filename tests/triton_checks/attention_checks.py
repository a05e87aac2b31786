"""Numerics of the Triton FlashAttention kernels against a float64 reference.

Run in its own process, since TRITON_INTERPRET must be set before triton is imported:
    TRITON_INTERPRET=1 python tests/triton_checks/attention_checks.py --device cpu
    python tests/triton_checks/attention_checks.py --device cuda
Options: --seed N (default 0; random draws one), --groups a,b (subset). Prints one JSON line per case and
exits 1 when any case fails. tests/test_triton_attention.py runs it and asserts per group.

Criterion (the FlashAttention project's rule): for out, lse, dq, dk, dv the max abs error of the
kernel vs float64 math must be <= 2 x the max abs error of the same-precision torch math vs
float64 + floor, and <= an absolute bound (1e-4 for fp32, 5e-2 for bf16). The floor is
2e-6 (fp32; 1e-4 for bf16) + the larger of 8 fp32 ulps of max|ref| and, for dq and dk, 2 ulps of
the largest term of dS = P * (dP - delta) that the FlashAttention-2 backward cancels (scale x
2 max|dO_i . V_j| x max|K| or max|Q|). Measured over many seeds both the kernel and torch's fp32
math land within ~7 ulps of max|ref|, so the 2x term alone flips on whichever draw gave torch a
lucky small error; with one visible key dq and dk are exactly 0 in float64 while fp32 keeps the
rounding of dP - delta: <= 0.7 ulps of that term over 300 seeds, while a floor on max|ref| alone
failed about one draw in a few hundred. A real bug (a wrong tile, a missing mask)
shows up as errors >= 1e-2. Where the reference is -inf (lse of rows with no
visible key) the kernel must be -inf too; anything else non-finite fails. MMP_KERNEL_POISON=1
(set here) makes the wrapper fill every buffer with NaN before the kernels run, so an element
a kernel never writes fails the finiteness check.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

ABS_BOUND = {"float32": 1e-4, "bfloat16": 5e-2}
FLOOR = {"float32": 2e-6, "bfloat16": 1e-4}
FLOOR_ULPS = 8
TERM_ULPS = 2
EPS32 = 2.0 ** -23


def _case(group, causal, lq, lk=None, *, b=2, h=2, hkv=None, d=16, scale=None, lse_grad=False,
          layout="bhld", dtype="float32"):
    """Dense case (lq, lk ints) or varlen case (lq, lk lists of per-sequence lengths)."""
    lk = lq if lk is None else lk
    varlen = isinstance(lq, list)
    name = (f"{group}:{'causal' if causal else 'full'}:q{lq}:k{lk}:h{h}/{hkv or h}:d{d}"
            f"{':b%d' % b if not varlen else ''}{':scale' if scale else ''}{':dlse' if lse_grad else ''}"
            f"{':' + layout if layout != 'bhld' else ''}{':' + dtype if dtype != 'float32' else ''}")
    return dict(name=name, group=group, causal=causal, lq=lq, lk=lk, b=b, h=h, hkv=hkv or h, d=d,
                scale=scale, lse_grad=lse_grad, layout=layout, dtype=dtype)


def cases(device: str):
    cs = []
    # Lengths around the interpreter tiles (fwd 32x16, dkdv 16x32, dq 32x16): 1, partial, just
    # under and just over a multiple.
    for causal in (False, True):
        cs += [_case("dense", causal, 1), _case("dense", causal, 17), _case("dense", causal, 63, b=1, d=64),
               _case("dense", causal, 65, b=1)]
    # Lq != Lk: causal is bottom-right aligned; lq > lk leaves rows with no visible key.
    for causal in (False, True):
        cs += [_case("cross", causal, 17, 40), _case("cross", causal, 40, 17), _case("cross", causal, 1, 65, b=1)]
    cs += [_case("cross", False, 63, 5, b=1)]
    for causal in (False, True):
        cs += [_case("gqa", causal, 33, h=4, hkv=2), _case("gqa", causal, 47, 30, b=1, h=4, hkv=1, d=64)]
    for causal in (False, True):
        cs += [_case("varlen", causal, [1, 17, 40, 5], hkv=1),
               _case("varlen", causal, [1, 17, 40, 5], [3, 17, 20, 9], h=4, hkv=2)]
    # a sequence with no keys (all its rows empty) and one with no queries
    cs += [_case("varlen", True, [4, 0, 33], [0, 5, 33], h=2, hkv=1)]
    cs += [_case("lse_grad", True, 40, 17, lse_grad=True, h=4, hkv=2),
           _case("lse_grad", False, [1, 17, 40, 5], [3, 17, 20, 9], lse_grad=True, h=2, hkv=1)]
    # strided (B, L, H, D) views as the model passes them, and a custom scale
    cs += [_case("layout", True, 33, 20, layout="blhd", scale=0.3, h=4, hkv=2),
           _case("layout", False, 17, layout="blhd", b=1, scale=0.05)]
    cs += [_case("d128", True, 65, b=1, h=2, hkv=1, d=128)]
    if device == "cuda":  # native runs are cheap: larger shapes and the training dtype
        for causal in (False, True):
            cs += [_case("cuda_large", causal, 1000, 1000, b=2, h=8, hkv=2, d=128),
                   _case("cuda_large", causal, [1, 513, 300, 1024], h=4, hkv=4, d=64),
                   _case("bf16", causal, 257, 300, h=8, hkv=2, d=128, dtype="bfloat16", lse_grad=True),
                   _case("bf16", causal, [1, 513, 300, 77], h=4, hkv=1, d=64, dtype="bfloat16")]
    return cs


def _make(case, device, gen):
    import torch
    b, h, hkv, d = case["b"], case["h"], case["hkv"], case["d"]

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device)

    if isinstance(case["lq"], list):
        tq, tk = sum(case["lq"]), sum(case["lk"])
        q, k, v = rnd(tq, h, d), rnd(tk, hkv, d), rnd(tk, hkv, d)
    elif case["layout"] == "blhd":
        q = rnd(b, case["lq"], h, d).transpose(1, 2)
        k, v = rnd(b, case["lk"], hkv, d).transpose(1, 2), rnd(b, case["lk"], hkv, d).transpose(1, 2)
    else:
        q, k, v = rnd(b, h, case["lq"], d), rnd(b, hkv, case["lk"], d), rnd(b, hkv, case["lk"], d)
    return q, k, v


def _cu(lens, device):
    import torch
    return torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


def _reference(case, q, k, v, dtype):
    """(out, lse) from the math reference in `dtype`, GQA expanded, per sequence for varlen."""
    import torch
    from common.kernels.attention import attention_reference
    rep = case["h"] // case["hkv"]
    kw = dict(causal=case["causal"], scale=case["scale"], dtype=dtype)
    if not isinstance(case["lq"], list):
        return attention_reference(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), **kw)
    outs, lses, sq, sk = [], [], 0, 0
    for lq, lk in zip(case["lq"], case["lk"]):
        qi = q[sq:sq + lq].transpose(0, 1)[None]
        ki, vi = (x[sk:sk + lk].transpose(0, 1)[None].repeat_interleave(rep, 1) for x in (k, v))
        if lk == 0:
            oi = qi.to(dtype) * 0
            li = torch.full(qi.shape[:3], float("-inf"), dtype=dtype, device=q.device)
        else:
            oi, li = attention_reference(qi, ki, vi, **kw)
        outs.append(oi[0].transpose(0, 1))
        lses.append(li[0])
        sq, sk = sq + lq, sk + lk
    return torch.cat(outs, 0), torch.cat(lses, -1)


def _cancelled_term(case, q, k, v, go) -> dict[str, float]:
    """Upper bound of |scale * (dP_ij - delta_i) * K| (dq) and |... * Q| (dk): the size of what
    cancels in the backward, whatever the size of the result."""
    scale = case["scale"] or case["d"] ** -0.5
    # |delta_i| = |dO_i . O_i| <= max_j |dO_i . V_j| (O_i is a convex mix of V); pairs across heads
    # and sequences are included, which only loosens the bound.
    d = go.shape[-1]
    diff = 2 * scale * float((go.reshape(-1, d) @ v.reshape(-1, d).T).abs().max())
    return {"dq": diff * float(k.abs().max()), "dk": diff * float(q.abs().max())}


def _grads(fn, inputs, go, gl):
    """(out, lse, dq, dk, dv) of fn with loss sum(out * go) [+ sum(lse * gl) over finite lse]."""
    import torch
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out, lse = fn(*leaves)
    loss = (out.float() * go).sum()
    if gl is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).float() * gl).sum()
    grads = torch.autograd.grad(loss, leaves)
    return (out.detach(), lse.detach(), *grads)


def run_case(case, device, seed):
    import torch
    from common.kernels.attention import attention
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case["dtype"])
    q, k, v = _make(case, device, gen)
    varlen = isinstance(case["lq"], list)
    extra = {}
    if varlen:
        extra = dict(cu_seqlens_q=_cu(case["lq"], device), cu_seqlens_k=_cu(case["lk"], device),
                     max_seqlen_q=max(case["lq"]), max_seqlen_k=max(case["lk"]))
    go = torch.randn(q.shape, generator=gen).to(device)
    lse_shape = (q.shape[1], q.shape[0]) if varlen else q.shape[:3]
    gl = torch.randn(lse_shape, generator=gen).to(device) if case["lse_grad"] else None

    def kernel(q_, k_, v_):
        return attention(q_, k_, v_, causal=case["causal"], scale=case["scale"], return_lse=True,
                         backend="triton", **extra)

    def ref(dt):
        return lambda q_, k_, v_: _reference(case, q_, k_, v_, dt)

    got = _grads(kernel, [x.to(dtype) for x in (q, k, v)], go, gl)
    ref64 = _grads(ref(torch.float64), [x.double() for x in (q, k, v)], go.double(),
                   None if gl is None else gl.double())
    # The same-precision reference sees the same (rounded) inputs as the kernel.
    lowp = _grads(ref(dtype), [x.to(dtype) for x in (q, k, v)], go, gl)
    res = dict(name=case["name"], group=case["group"], seed=seed, ok=True, errors={}, failures=[])
    term = _cancelled_term(case, q, k, v, go)
    for name, a, r, p in zip(("out", "lse", "dq", "dk", "dv"), got, ref64, lowp):
        if a.shape != r.shape:
            res["failures"].append(f"{name}: shape {tuple(a.shape)} != {tuple(r.shape)}")
            continue
        a, p = a.double(), p.double()
        fin = torch.isfinite(r)
        assert not torch.isnan(r).any(), "float64 reference produced NaN"
        if not torch.equal(torch.isneginf(a), torch.isneginf(r)):
            res["failures"].append(f"{name}: -inf pattern differs from the reference")
        if not torch.isfinite(a[fin]).all():
            res["failures"].append(f"{name}: {int((~torch.isfinite(a[fin])).sum())} non-finite values "
                                   "(NaN = unwritten poisoned output or a numerical bug)")
            continue
        err = float((a - r)[fin].abs().max()) if fin.any() else 0.0
        ref_err = float((p - r)[fin].abs().max()) if fin.any() else 0.0
        max_abs = float(r[fin].abs().max()) if fin.any() else 0.0
        floor = FLOOR[case["dtype"]] + EPS32 * max(FLOOR_ULPS * max_abs, TERM_ULPS * term.get(name, 0.0))
        bound = min(2 * ref_err + floor, ABS_BOUND[case["dtype"]])
        res["errors"][name] = dict(err=err, ref_err=ref_err, bound=bound, max_abs=max_abs)
        if not err <= bound:
            res["failures"].append(f"{name}: max abs err {err:.3g} > bound {bound:.3g} = min(2 x torch "
                                   f"{case['dtype']} err {ref_err:.3g} + floor {floor:.3g}, "
                                   f"{ABS_BOUND[case['dtype']]:g}); max|ref| {max_abs:.3g}")
    res["ok"] = not res["failures"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--seed", default="0", help="input seed (default 0: the same inputs every run) or random")
    ap.add_argument("--groups", default="")
    args = ap.parse_args(argv)
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        print("set TRITON_INTERPRET=1 to run the kernels on CPU", file=sys.stderr)
        return 2
    os.environ.setdefault("MMP_KERNEL_POISON", "1")
    import torch
    from common.kernels.triton import flash_attention as fa
    if args.device == "cpu":
        assert fa.interpreted(), "TRITON_INTERPRET=1 was not seen by triton"
        torch.set_num_threads(1)  # tiny matmuls; threads only add contention on a shared machine
    seed = int.from_bytes(os.urandom(4), "little") if args.seed == "random" else int(args.seed)
    groups = set(filter(None, args.groups.split(",")))
    failed = 0
    for i, case in enumerate(cases(args.device)):
        if groups and case["group"] not in groups:
            continue
        t0 = time.time()
        try:
            res = run_case(case, args.device, seed + i)
        except Exception:
            res = dict(name=case["name"], group=case["group"], seed=seed + i, ok=False, errors={},
                       failures=[traceback.format_exc(limit=6)])
        res["seconds"] = round(time.time() - t0, 3)
        res["run_seed"] = seed
        failed += not res["ok"]
        print(json.dumps(res), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
