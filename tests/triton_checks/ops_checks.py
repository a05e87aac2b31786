"""Numerics of the Triton norm / norm+modulate / RoPE / SwiGLU / cross-entropy kernels.

Run in its own process: on CPU the kernels run through the Triton interpreter, which has to be
switched on (TRITON_INTERPRET=1) before triton is imported. tests/test_triton_ops.py launches it.

    TRITON_INTERPRET=1 python tests/triton_checks/ops_checks.py [--device cpu|cuda] [--seed N]

Rule, per output (forward value and every input gradient): with ref = the op in float64 torch,
    err_kernel = max|kernel_fp32 - ref|,  err_torch = max|torch_fp32 - ref|
    pass iff err_kernel <= 2 * err_torch + floor  and  err_kernel <= ABS_BOUND (1e-4), all finite,
floor = 1e-6 * max(1, max|ref|) (a few fp32 ulps of the output's scale: a max error of one run
of the fp32 torch path can land near zero by luck; the floor keeps such a run from failing a
kernel that is exactly as accurate). Outputs are allocated NaN-filled (MMP_KERNEL_POISON=1), so
an element a kernel never writes fails. On CUDA the same checks run natively, plus bf16 forms
with a bf16-scale floor (2^-7 max|ref|) and, for the absolute bound, 2^-4 max|ref| (8-16 bf16 ulps
of the largest output: a fixed 2^-4 failed outputs near 12 on an H200, where kernel and torch alike
are one ulp off). Prints one JSON object; exit code 0 iff every check passed.

    python tests/triton_checks/ops_checks.py --compile-sm90

compiles every kernel variant the wrappers launch for an H100/H200 (sm_90) with the warp counts
they use, no GPU needed (Triton's bundled ptxas), and reports registers and spill stack per
kernel: the interpreter does not catch what only the compiler rejects (loop-carried types,
constexpr misuse), and spills are the first thing to look at when a kernel is slow.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

ABS_BOUND = 1e-4  # fp32 outputs here have magnitudes below ~30
FLOOR = 1e-6


def compile_sm90() -> int:
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from common.kernels.triton import cross_entropy as tce
    from common.kernels.triton import norm, rope, swiglu

    target = GPUTarget("cuda", 90, 32)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    results = []

    def comp(fn, types: dict, consts: dict, warps: int):
        sig = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
        row = {"kernel": fn.__name__, "consts": consts, "num_warps": warps}
        try:
            k = triton.compile(ASTSource(fn, sig, consts), target=target, options={"num_warps": warps})
            row["ok"] = True
            if os.path.exists(cuobjdump):
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(k.asm["cubin"])
                    f.flush()
                    out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True,
                                         text=True).stdout
                m = re.search(r"REG:(\d+).*?STACK:(\d+)", out, re.S)
                if m:
                    row["registers"], row["spill_stack_bytes"] = int(m.group(1)), int(m.group(2))
        except Exception as e:  # noqa: BLE001 - reported per kernel
            row["ok"], row["error"] = False, f"{type(e).__name__}: {e}"[-2000:]
        results.append(row)

    for dt in ("bf16",):  # the CUDA training dtype; fp32 takes the same code paths
        p = "*" + dt
        for d in (130, 4096):
            bd = triton.next_power_of_2(d)
            for rms, has_b, mod in ((True, False, False), (False, True, False), (False, False, True), (True, False, True)):
                flags = dict(IS_RMS=rms, HAS_W=not mod, HAS_B=has_b, HAS_MOD=mod, BLOCK_D=bd)
                comp(norm._norm_fwd, dict(X=p, Y=p, W=p, B=p, SCALE=p, SHIFT=p, MEAN="*fp32", RSTD="*fp32",
                                          stride_x="i32", stride_y="i32", stride_sc="i32", stride_sh="i32", D="i32",
                                          rows_per_group="i32", eps="fp32"), flags, norm._num_warps(bd))
                comp(norm._norm_bwd, dict(X=p, DY=p, DX=p, W=p, B=p, SCALE=p, MEAN="*fp32", RSTD="*fp32",
                                          DW_PART="*fp32", DB_PART="*fp32", DSC_PART="*fp32", DSH_PART="*fp32",
                                          stride_x="i32", stride_dy="i32", stride_dx="i32", stride_sc="i32", D="i32",
                                          rows_per_group="i32", rows_per_prog="i32"), flags, norm._num_warps(bd))
        for d in (64, 128):
            br, bh, warps = rope.config(d)
            for bw in (False, True):
                comp(rope._rope_kernel, dict(X=p, Y=p, COS="*fp32", SIN="*fp32", n_rows="i32", H="i32", L="i32",
                                             sxb="i64", sxh="i32", sxl="i32", syb="i64", syh="i32", syl="i32",
                                             s_cos="i32", s_sin="i32", HALF="i32"),
                     dict(BACKWARD=bw, BLOCK_R=br, BLOCK_H=bh), warps)
        comp(swiglu._swiglu_fwd, dict(A=p, B=p, Y=p, N="i32", sa="i32", sb="i32", sy="i32"), dict(BLOCK=swiglu.BLOCK), 4)
        comp(swiglu._swiglu_bwd, dict(A=p, B=p, DY=p, DA=p, DB=p, N="i32", sa="i32", sb="i32", sdy="i32", sda="i32",
                                      sdb="i32"), dict(BLOCK=swiglu.BLOCK), 4)
        bv, warps = tce._block_v(128256, None)
        comp(tce._ce_fwd_chunk, dict(LOGITS=p, TGT="*i64", M_IN="*fp32", M_OUT="*fp32", S_IN="*fp32", S_OUT="*fp32",
                                     XT_IN="*fp32", XT_OUT="*fp32", stride_l="i32", n_cols="i32", v0="i32",
                                     ignore_index="i32"), dict(BLOCK_V=bv), warps)
        comp(tce._ce_grad_chunk, dict(LOGITS=p, OUT=p, TGT="*i64", M="*fp32", LOG_S="*fp32", G="*fp32",
                                      stride_l="i32", stride_o="i32", n_cols="i32", v0="i32"), dict(BLOCK_V=bv), warps)
    ok = all(r["ok"] for r in results)
    print(json.dumps({"ok": ok, "target": "cuda sm_90", "triton": triton.__version__, "results": results}))
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--seed", default="0", help="input seed (default 0: the same inputs every run) or random")
    ap.add_argument("--compile-sm90", action="store_true")
    args = ap.parse_args()
    if args.compile_sm90:
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            print(json.dumps({"ok": False, "error": "--compile-sm90 needs TRITON_INTERPRET unset"}))
            return 2
        return compile_sm90()
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print(json.dumps({"ok": False, "error": "CPU checks need TRITON_INTERPRET=1 set before launch"}))
        return 2
    os.environ["MMP_KERNEL_POISON"] = "1"

    import torch
    import torch.nn.functional as F

    from common.kernels import (apply_rope, cross_entropy, cross_entropy_eager, layer_norm, norm_modulate,
                                resolve_backend, rms_norm, rope_frequencies, swiglu)
    from common.kernels.cross_entropy import ChunkedLinearCrossEntropy
    from common.kernels.triton import cross_entropy as tce
    from common.kernels.triton import norm as tnorm

    seed = int.from_bytes(os.urandom(4), "little") if args.seed == "random" else int(args.seed)
    torch.manual_seed(seed)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 torch reference must be real fp32
    results: list[dict] = []

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, dtype=torch.float64, device=dev) * scale

    def run(fn, inputs, dtype, grad_out):
        """fn(*inputs cast to dtype) -> (output, grads of the floating tensor inputs)."""
        xs = [t.detach().to(dtype).requires_grad_() if torch.is_tensor(t) and t.is_floating_point() else t
              for t in inputs]
        out = fn(*xs)
        diff = [t for t in xs if torch.is_tensor(t) and t.requires_grad]
        grads = torch.autograd.grad(out, diff, grad_out.to(out.dtype))
        return [out.detach()] + [g.detach() for g in grads]

    def check(op, case, kernel_fn, torch_fn, inputs, dtype=torch.float32, floor_rel=FLOOR, abs_bound=ABS_BOUND,
              abs_rel=None):
        """abs_rel: the absolute bound as a fraction of max|ref| instead (bf16: its rounding
        grows with the output's magnitude, so a fixed bound fails outputs above ~8)."""
        t0 = time.perf_counter()
        xs64 = [t.detach().requires_grad_() if torch.is_tensor(t) and t.is_floating_point() else t for t in inputs]
        out64 = torch_fn(*xs64)
        g = torch.randn_like(out64)
        diff = [t for t in xs64 if torch.is_tensor(t) and t.requires_grad]
        ref = [out64.detach()] + [x.detach() for x in torch.autograd.grad(out64, diff, g)]
        ker = run(kernel_fn, inputs, dtype, g)
        tor = run(torch_fn, inputs, dtype, g)
        names = ["forward"] + [f"grad[{i}]" for i in range(len(ref) - 1)]
        for name, r, k, t in zip(names, ref, ker, tor):
            finite = bool(torch.isfinite(k).all()) and k.shape == r.shape
            ek = (k.double() - r).abs().max().item() if finite else math.inf
            et = (t.double() - r).abs().max().item()
            scale = max(1.0, r.abs().max().item())
            bound = 2 * et + floor_rel * scale
            limit = abs_bound if abs_rel is None else abs_rel * scale
            ok = finite and ek <= bound and ek <= limit
            results.append({"op": op, "case": case, "dtype": str(dtype).replace("torch.", ""), "what": name,
                            "err_kernel": ek, "err_torch": et, "bound": bound, "abs_limit": limit, "ok": ok,
                            "seconds": round(time.perf_counter() - t0, 2)})

    eps = 1e-6
    # ---- RMSNorm / LayerNorm through the dispatch (backend="triton" runs the kernel on CPU
    #      only because TRITON_INTERPRET is set) -------------------------------------------
    for shape, affine in (((3, 5, 48), True), ((1, 130), False)):
        d = shape[-1]
        w = rand(d) if affine else None
        check("rms_norm", f"{shape} weight={affine}",
              lambda x, w: rms_norm(x, w, eps, backend="triton"),
              lambda x, w: rms_norm(x, w, eps, backend="torch"), [rand(*shape, scale=3.0) + 1.0, w])
        b = rand(d) if affine else None
        check("layer_norm", f"{shape} affine={affine}",
              lambda x, w, b: layer_norm(x, w, b, eps, backend="triton"),
              lambda x, w, b: layer_norm(x, w, b, eps, backend="torch"), [rand(*shape, scale=3.0) + 1.0, w, b])
    # q/k-norm layout: a (B, H, L, D) view of (B, L, H, D) memory, rows walked in memory order
    check("rms_norm", "(2,3,7,48) head view",
          lambda x, w: rms_norm(x.transpose(1, 2), w, eps, backend="triton"),
          lambda x, w: rms_norm(x.transpose(1, 2), w, eps, backend="torch"), [rand(2, 7, 3, 48), rand(48)])

    # ---- norm + adaLN modulate -----------------------------------------------------------
    for (b_, n, d) in ((2, 5, 48), (1, 1, 130), (3, 9, 130)):
        check("norm_modulate", f"LN x({b_},{n},{d}) scale/shift ({b_},{d})",
              lambda x, sh, sc: norm_modulate(x, sh, sc, eps, backend="triton"),
              lambda x, sh, sc: norm_modulate(x, sh, sc, eps, backend="torch"),
              [rand(b_, n, d, scale=2.0), rand(b_, d), rand(b_, d)])

    def mod_ref(x, w, b, sh, sc, rms):
        y = rms_norm(x, w, eps, backend="torch") if rms else layer_norm(x, w, b, eps, backend="torch")
        return y * (1 + sc) + sh

    check("norm_modulate", "LN+affine x(2,6,48) scale/shift (2,1,48)",
          lambda x, w, b, sh, sc: tnorm.norm_modulate(x, w, b, sh, sc, eps),
          lambda x, w, b, sh, sc: mod_ref(x, w, b, sh, sc, False),
          [rand(2, 6, 48), rand(48), rand(48), rand(2, 1, 48), rand(2, 1, 48)])
    check("norm_modulate", "RMS+weight x(2,5,130) per-token scale/shift",
          lambda x, w, sh, sc: tnorm.norm_modulate(x, w, None, sh, sc, eps, rms=True),
          lambda x, w, sh, sc: mod_ref(x, w, None, sh, sc, True),
          [rand(2, 5, 130), rand(130), rand(2, 5, 130), rand(2, 5, 130)])

    # ---- RoPE: 2-D axes table, 1-D table with a half width that is not a power of two ------
    side = 3
    r, c = torch.meshgrid(torch.arange(side), torch.arange(side + 1), indexing="ij")
    cos2, sin2 = rope_frequencies(torch.stack([r.flatten(), c.flatten()], -1).to(dev), (24, 24))
    cos1, sin1 = rope_frequencies(torch.arange(5, device=dev) * 7, (130,))
    for name, x, cs, sn, view in (
            ("(2,3,12,48) 2-D table", rand(2, 3, 12, 48), cos2, sin2, False),
            ("(2,5,4,130) head view, 1-D table", rand(2, 5, 4, 130), cos1, sin1, True)):
        tr = (lambda t: t.transpose(1, 2)) if view else (lambda t: t)
        check("rope", name,
              lambda x, cs=cs, sn=sn, tr=tr: apply_rope(tr(x), cs, sn, backend="triton"),
              lambda x, cs=cs, sn=sn, tr=tr: apply_rope(tr(x), cs.to(x.dtype), sn.to(x.dtype), backend="torch"),
              [x])

    # ---- SwiGLU: split and fused forms ---------------------------------------------------
    check("swiglu", "a,b (3,5,130)", lambda a, b: swiglu(a, b, backend="triton"),
          lambda a, b: F.silu(a) * b, [rand(3, 5, 130, scale=3.0), rand(3, 5, 130)])
    check("swiglu", "fused (1,2*48)", lambda x: swiglu(x, backend="triton"),
          lambda x: F.silu(x[..., :48]) * x[..., 48:], [rand(1, 96, scale=3.0)])
    check("swiglu", "fused (4,7,2*1100) two column blocks",
          lambda x: swiglu(x, backend="triton"),
          lambda x: F.silu(x[..., :1100]) * x[..., 1100:], [rand(4, 7, 2200, scale=3.0)])

    # ---- cross-entropy: vocab 1000 in slices of 300 (ragged last slice), tiles of 128 (ragged
    #      last tile), every 5th target ignored ------------------------------------------------
    t_, hd, v = 37, 24, 1000
    tgt = torch.randint(0, v, (t_,), device=dev)
    tgt[::5] = -100
    ops = tce.TritonChunkOps(block_v=128)
    for red in ("mean", "none"):
        check("cross_entropy", f"T={t_} D={hd} V={v} chunk=300 reduction={red}",
              lambda h, w, red=red: ChunkedLinearCrossEntropy.apply(h, w, tgt, -100, 300, red, ops),
              lambda h, w, red=red: cross_entropy_eager(h, w, tgt, reduction=red), [rand(t_, hd), rand(v, hd)])
    tgt1 = torch.randint(0, 130, (1,), device=dev)
    check("cross_entropy", "single row V=130 via dispatch",
          lambda h, w: cross_entropy(h, w, tgt1, chunk_size=64, backend="triton"),
          lambda h, w: cross_entropy_eager(h, w, tgt1), [rand(1, 16), rand(130, 16)])

    if dev.type == "cuda":
        # Native-only extras: bf16 forms (floor at bf16 scale) and the tile widths the kernels
        # pick by default at realistic widths; every kernel above and below is called with
        # backend="triton", so these checks hold whatever "auto" picks. "auto" itself must follow
        # the benchmark's table: Triton for the ops in AUTO_TRITON_OPS, torch for the others,
        # and "triton" must stay "triton" when asked for by name.
        from common.kernels.backend import AUTO_TRITON_OPS, TRITON_OPS
        for op in sorted(TRITON_OPS):
            picked = resolve_backend(None, op=op, device=dev)
            want = "triton" if op in AUTO_TRITON_OPS else "torch"
            results.append({"op": op, "case": "auto on cuda", "what": f"resolves to {picked}, AUTO_TRITON_OPS "
                            f"says {want}", "ok": picked == want})
            named = resolve_backend("triton", op=op, device=dev)
            results.append({"op": op, "case": "triton by name on cuda", "what": f"resolves to {named}",
                            "ok": named == "triton"})
        bf = torch.bfloat16
        check("rms_norm", "(64,4096) weight", lambda x, w: rms_norm(x, w, eps, backend="triton"),
              lambda x, w: rms_norm(x, w, eps, backend="torch"), [rand(64, 4096), rand(4096)],
              dtype=bf, floor_rel=2 ** -7, abs_rel=2 ** -4)
        check("norm_modulate", "(4,33,4096)", lambda x, sh, sc: norm_modulate(x, sh, sc, eps, backend="triton"),
              lambda x, sh, sc: norm_modulate(x, sh, sc, eps, backend="torch"),
              [rand(4, 33, 4096), rand(4, 4096), rand(4, 4096)], dtype=bf, floor_rel=2 ** -7, abs_rel=2 ** -4)
        check("swiglu", "(64, 2*5000)", lambda x: swiglu(x, backend="triton"),
              lambda x: swiglu(x, backend="torch"), [rand(64, 10000)], dtype=bf, floor_rel=2 ** -7,
              abs_rel=2 ** -4)
        tg = torch.randint(0, 50000, (512,), device=dev)
        tg[::7] = -100
        check("cross_entropy", "T=512 D=256 V=50000 slices of 12288, default tiles",
              lambda h, w: cross_entropy(h, w, tg, chunk_size=12288, backend="triton"),
              lambda h, w: cross_entropy_eager(h, w, tg), [rand(512, 256, scale=0.1), rand(50000, 256, scale=0.1)],
              floor_rel=2e-6)

    ok = all(r["ok"] for r in results)
    print(json.dumps({"ok": ok, "seed": seed, "device": str(dev), "results": results}))
    if not ok:
        print(f"FAILED with seed {seed}: rerun with --seed {seed}", file=sys.stderr)
        for r in results:
            if not r["ok"]:
                print("  " + json.dumps(r), file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
