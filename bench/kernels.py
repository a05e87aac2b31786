"""GPU kernel benchmark: our Triton kernels against the torch paths they replace.

For each op and size: forward and forward+backward median time (triton.testing.do_bench, L2
flushed between runs), then
  attention          achieved TFLOP/s: 4*B*H*L*L*D forward (halved when causal); backward counted
                     as 2.5x forward (FlashAttention convention), so forward+backward = 3.5x;
  memory-bound ops   achieved GB/s over the bytes an ideal kernel moves (each input read once,
                     each output written once), and that as a fraction of this device's copy
                     bandwidth (a large tensor copy timed the same way);
  cross_entropy      model TFLOP/s (2*T*D*V forward, 6*T*D*V forward+backward, although the chunked
                     paths recompute the logits: 8*T*D*V executed) and peak memory of one
                     forward+backward (torch.cuda.max_memory_allocated above the inputs) vs eager;
and the speed ratio to the reference implementation of the op (SDPA for attention, the torch
dispatch path for the rest, eager for cross-entropy); attention rows also carry the ratio to SDPA
pinned to its flash backend (`sdpa_flash`, FlashAttention-2 inside torch; `sdpa_cudnn` too in the
full set). `auto_triton` in the JSON says, per op,
whether Triton beat the reference at every measured size: what AUTO_TRITON_OPS
(common/kernels/backend.py) should contain on this device.

  python bench/kernels.py [--quick | --check] [--ops attention,norm,norm_modulate,rope,swiglu,cross_entropy]
                          [--out bench/results/kernels.json] [--time-budget SECONDS]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

OPS = ("norm", "norm_modulate", "rope", "swiglu", "cross_entropy", "attention")
# Share of the time budget per op (attention has by far the most cases); what an op leaves unused
# flows to the ones after it.
WEIGHTS = {"norm": 1, "norm_modulate": 1, "rope": 1, "swiglu": 1, "cross_entropy": 2, "attention": 4}
REFERENCE = {"attention": "torch", "cross_entropy": "eager"}  # others: "torch"
# Further impls every row of an op is also compared with (a speedup_vs_<name> column each).
EXTRA_REFS = {"attention": ("sdpa_flash",)}
FULL = {"tokens": (16384, 32768, 65536), "d": 4096, "ce_tokens": (8192, 16384), "vocab": 128256,
        "attn_seqs": (1024, 2048, 4096, 8192, 16384), "attn_tokens": 16384, "attn_width": 2048,
        "head_dims": (64, 128), "rope_heads": 32, "batch": 8}
QUICK = dict(FULL, tokens=(16384,), ce_tokens=(8192,), attn_seqs=(2048, 8192))
# --check: what bench/gpu_check.sh runs in its ~2 minutes: attention at head dim 128 over L 1k-16k
# (fwd and fwd+bwd, causal and not), the memory-bound ops at two sizes, cross-entropy at a 128k vocab.
CHECK = dict(FULL, tokens=(16384, 65536), ce_tokens=(8192,), head_dims=(128,), sdpa_cudnn=False)
# --smoke-cpu: the script's own check on a machine without a GPU (torch impls only; numbers meaningless)
SMOKE = {"tokens": (64,), "d": 48, "ce_tokens": (37,), "vocab": 1000, "attn_seqs": (16,), "attn_tokens": 32,
         "attn_width": 64, "head_dims": (16, 32), "rope_heads": 2, "batch": 2}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes (a few minutes on an H100/H200)")
    ap.add_argument("--check", action="store_true",
                    help="the sizes bench/gpu_check.sh measures (d=128 attention at L 1k-16k; ~2 minutes)")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "kernels.json"))
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds for all measurements; cases past an op's share are recorded as skipped")
    ap.add_argument("--smoke-cpu", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in args.ops if o not in OPS]
    if bad:
        ap.error(f"unknown ops {bad}; choose from {OPS}")
    return args


class Bench:
    def __init__(self, args):
        import torch
        import triton.testing
        self.torch, self.do_bench = torch, triton.testing.do_bench
        self.args, self.rows, self.skipped = args, [], []
        self.dev = torch.device("cpu" if args.smoke_cpu else "cuda")
        self.cuda = self.dev.type == "cuda"
        self.copy_gbps = self._copy_bandwidth()
        self.deadline = None if args.time_budget is None else time.monotonic() + args.time_budget
        self.op_deadline = None

    def time_ms(self, fn) -> float:
        if not self.cuda:  # smoke run: do_bench needs a GPU
            times = []
            for _ in range(3):
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
            return sorted(times)[1]
        return self.do_bench(fn, warmup=10, rep=40, return_mode="median")

    def _copy_bandwidth(self) -> float:
        torch = self.torch
        n = (1 << 29) if self.cuda else (1 << 20)
        x = torch.empty(n, dtype=torch.bfloat16, device=self.dev)  # 1 GiB: far beyond L2
        y = torch.empty_like(x)
        ms = self.time_ms(lambda: y.copy_(x))
        del x, y
        return 2 * 2 * n / (ms * 1e-3) / 1e9

    def out_of_time(self) -> bool:
        return self.op_deadline is not None and time.monotonic() > self.op_deadline

    def case(self, op, shape, impls, *, make, bytes_fwd=None, bytes_bwd=None, flops_fwd=None, flops_fb=None,
             memory=False):
        """Measure every impl (name -> fn(inputs) -> output) on inputs = make(); record rows."""
        torch = self.torch
        shape_s = "x".join(str(s) for s in shape) if isinstance(shape, tuple) else str(shape)
        if self.out_of_time():
            self.skipped.append({"op": op, "shape": shape_s, "reason": "time budget"})
            return
        try:
            inputs = make()
        except torch.OutOfMemoryError as e:
            self.skipped.append({"op": op, "shape": shape_s, "reason": f"OOM making inputs: {e}"[:200]})
            self.empty_cache()
            return
        diff = [t for t in inputs if torch.is_tensor(t) and t.requires_grad]
        results = {}
        for name, fn in impls.items():
            try:
                out = fn(*inputs)  # also the compile/autotune call, outside the timed runs
                grad = torch.randn_like(out) if out.dim() else torch.ones_like(out)
                del out
                fwd = self.time_ms(lambda: fn(*inputs))
                fb = self.time_ms(lambda: torch.autograd.grad(fn(*inputs), diff, grad))
                peak = None
                if memory and self.cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    torch.autograd.grad(fn(*inputs), diff, grad)
                    torch.cuda.synchronize()
                    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
                results[name] = (fwd, fb, peak)
            except Exception as e:  # noqa: BLE001 - a backend that cannot run is reported, not fatal
                self.skipped.append({"op": op, "shape": shape_s, "impl": name, "reason": f"{type(e).__name__}: {e}"[:300]})
                self.empty_cache()
        ref = REFERENCE.get(op.split(":")[0], "torch")
        for name, (fwd, fb, peak) in results.items():
            for pass_, ms in (("fwd", fwd), ("fwd+bwd", fb)):
                row = {"op": op, "shape": shape_s, "impl": name, "pass": pass_, "ms": round(ms, 4)}
                flops = flops_fwd if pass_ == "fwd" else flops_fb
                nbytes = bytes_fwd if pass_ == "fwd" else (None if bytes_fwd is None else bytes_fwd + bytes_bwd)
                if flops:
                    row["tflops"] = round(flops / (ms * 1e-3) / 1e12, 2)
                if nbytes:
                    gbps = nbytes / (ms * 1e-3) / 1e9
                    row["gbps"] = round(gbps, 1)
                    row["frac_copy_bw"] = round(gbps / self.copy_gbps, 3)
                for other in (ref, *EXTRA_REFS.get(op.split(":")[0], ())):
                    if other in results and name != other:
                        base = results[other][0] if pass_ == "fwd" else results[other][1]
                        row["speedup_vs_" + other] = round(base / ms, 3)
                if peak is not None and pass_ == "fwd+bwd":
                    row["peak_gib"] = round(peak, 3)
                    if ref in results and results[ref][2]:
                        row["mem_vs_" + ref] = round(peak / results[ref][2], 3)
                self.rows.append(row)
        del inputs, diff
        self.empty_cache()

    def empty_cache(self):
        if self.cuda:
            self.torch.cuda.empty_cache()


# ---- per-op cases ------------------------------------------------------------------------------

def bench_norm(b: Bench, cfg: dict):
    import torch
    import torch.nn.functional as F

    from common.kernels import layer_norm, rms_norm
    d, eps, bf = cfg["d"], 1e-6, torch.bfloat16

    def vec():
        return torch.randn(d, device=b.dev, dtype=bf, requires_grad=True)

    for m in cfg["tokens"]:
        e = 2 * m * d * 2  # bf16: read x + write y; the backward reads x, dy and writes dx
        b.case("rms_norm", (m, d), {
            "triton": lambda x, w: rms_norm(x, w, eps, backend="triton"),
            "torch": lambda x, w: rms_norm(x, w, eps, backend="torch"),
            "aten": lambda x, w: F.rms_norm(x, (d,), w, eps)},
            make=lambda: (torch.randn(m, d, device=b.dev, dtype=bf, requires_grad=True), vec()),
            bytes_fwd=e, bytes_bwd=1.5 * e)
        b.case("layer_norm", (m, d), {
            "triton": lambda x, w, bb: layer_norm(x, w, bb, eps, backend="triton"),
            "torch": lambda x, w, bb: layer_norm(x, w, bb, eps, backend="torch"),
            "aten": lambda x, w, bb: F.layer_norm(x, (d,), w, bb, eps)},
            make=lambda: (torch.randn(m, d, device=b.dev, dtype=bf, requires_grad=True), vec(), vec()),
            bytes_fwd=e, bytes_bwd=1.5 * e)


def bench_norm_modulate(b: Bench, cfg: dict):
    import torch

    from common.kernels import norm_modulate
    d, bsz, bf = cfg["d"], cfg["batch"], torch.bfloat16
    for m in cfg["tokens"]:
        e = 2 * m * d * 2
        mk = lambda: (torch.randn(bsz, m // bsz, d, device=b.dev, dtype=bf, requires_grad=True),  # noqa: E731
                      torch.randn(bsz, d, device=b.dev, dtype=bf, requires_grad=True),
                      torch.randn(bsz, d, device=b.dev, dtype=bf, requires_grad=True))
        b.case("norm_modulate", (bsz, m // bsz, d), {
            "triton": lambda x, sh, sc: norm_modulate(x, sh, sc, backend="triton"),
            "torch": lambda x, sh, sc: norm_modulate(x, sh, sc, backend="torch")},
            make=mk, bytes_fwd=e, bytes_bwd=1.5 * e)


def bench_rope(b: Bench, cfg: dict):
    import torch

    from common.kernels import apply_rope, rope_frequencies
    h, dh, bsz, bf = cfg["rope_heads"], cfg["d"] // cfg["rope_heads"], cfg["batch"], torch.bfloat16
    for m in cfg["tokens"]:
        seq = m // bsz
        cos, sin = rope_frequencies(torch.arange(seq, device=b.dev), (dh,))
        # the model's layout: (B, H, L, Dh) head view of a (B, L, H*Dh) projection
        mk = lambda: (torch.randn(bsz, seq, h, dh, device=b.dev, dtype=bf).transpose(1, 2).requires_grad_(),)  # noqa: E731
        e = 2 * m * h * dh * 2 + 2 * seq * dh * 4
        b.case("rope", (bsz, h, seq, dh), {
            "triton": lambda x: apply_rope(x, cos, sin, backend="triton"),
            "torch": lambda x: apply_rope(x, cos, sin, backend="torch")}, make=mk, bytes_fwd=e, bytes_bwd=e)


def bench_swiglu(b: Bench, cfg: dict):
    import torch

    from common.kernels import swiglu
    n, bf = cfg["d"], torch.bfloat16
    for m in cfg["tokens"]:
        mk = lambda: (torch.randn(m, n, device=b.dev, dtype=bf, requires_grad=True),  # noqa: E731
                      torch.randn(m, n, device=b.dev, dtype=bf, requires_grad=True))
        e = m * n * 2
        b.case("swiglu", (m, n), {
            "triton": lambda a, g: swiglu(a, g, backend="triton"),
            "torch": lambda a, g: swiglu(a, g, backend="torch")}, make=mk, bytes_fwd=3 * e, bytes_bwd=5 * e)


def bench_cross_entropy(b: Bench, cfg: dict):
    import torch

    from common.kernels import cross_entropy, cross_entropy_eager
    d, v, bf = cfg["d"], cfg["vocab"], torch.bfloat16
    for t in cfg["ce_tokens"]:
        tgt = torch.randint(0, v, (t,), device=b.dev)
        tgt[::50] = -100
        mk = lambda: (torch.randn(t, d, device=b.dev, dtype=bf, requires_grad=True),  # noqa: E731
                      (torch.randn(v, d, device=b.dev, dtype=bf) * d ** -0.5).requires_grad_())
        f = 2 * t * d * v
        b.case("cross_entropy", (t, d, v), {
            "triton": lambda h, w: cross_entropy(h, w, tgt, backend="triton"),
            "torch": lambda h, w: cross_entropy(h, w, tgt, backend="torch"),
            "eager": lambda h, w: cross_entropy_eager(h, w, tgt)},
            make=mk, flops_fwd=f, flops_fb=3 * f, memory=True)


def bench_attention(b: Bench, cfg: dict):
    import torch

    from common.kernels import attention
    # FlashAttention-2 paper setting: B*L = 16k tokens, H*D = 2048
    bf, tokens, width = torch.bfloat16, cfg["attn_tokens"], cfg["attn_width"]
    for dh in cfg["head_dims"]:
        h = width // dh
        for seq in cfg["attn_seqs"]:
            bsz = max(1, tokens // seq)
            for causal in (False, True):
                mk = lambda: tuple(torch.randn(bsz, h, seq, dh, device=b.dev, dtype=bf, requires_grad=True)  # noqa: E731
                                   for _ in range(3))
                f = 4 * bsz * h * seq * seq * dh / (2 if causal else 1)
                impls = {name: (lambda q, k, v, name=name, causal=causal: attention(q, k, v, causal=causal, backend=name))
                         for name in ("triton", "torch", "flash_attn")}
                # SDPA pinned to one backend (an impl that cannot serve the call is reported as skipped)
                for name, sdpa_backend in sdpa_backends(cfg):
                    impls[name] = (lambda q, k, v, bk=sdpa_backend, causal=causal: pinned_sdpa(q, k, v, causal, bk))
                b.case("attention:causal" if causal else "attention", (bsz, h, seq, dh), impls, make=mk,
                       flops_fwd=f, flops_fb=3.5 * f)


def sdpa_backends(cfg: dict) -> list[tuple[str, object]]:
    from torch.nn.attention import SDPBackend
    out = [("sdpa_flash", SDPBackend.FLASH_ATTENTION)]
    if cfg.get("sdpa_cudnn", True) and hasattr(SDPBackend, "CUDNN_ATTENTION"):
        out.append(("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION))
    return out


def pinned_sdpa(q, k, v, causal: bool, backend):
    """SDPA restricted to one backend (the backward is that backend's too: autograd records the op
    the forward dispatched to)."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def auto_triton(rows) -> dict:
    """op -> True when Triton's forward+backward beat the reference at every measured size."""
    out = {}
    for r in rows:
        if r["impl"] != "triton" or r["pass"] != "fwd+bwd":
            continue
        key = "speedup_vs_" + REFERENCE.get(r["op"].split(":")[0], "torch")
        if key not in r:
            continue
        op = r["op"].split(":")[0]
        out[op] = out.get(op, True) and r[key] > 1.0
    return out


def print_table(b: Bench):
    cols = ["op", "shape", "impl", "pass", "ms", "tflops", "gbps", "frac_copy_bw", "speedup", "vs_sdpa_flash",
            "peak_gib", "mem_vs"]
    lines = [cols]
    for r in b.rows:
        sp = r.get("speedup_vs_" + REFERENCE.get(r["op"].split(":")[0], "torch"), "")
        mv = next((v for k, v in r.items() if k.startswith("mem_vs_")), "")
        lines.append([str(r.get(c, "")) for c in cols[:8]]
                     + [str(sp), str(r.get("speedup_vs_sdpa_flash", "")), str(r.get("peak_gib", "")), str(mv)])
    widths = [max(len(ln[i]) for ln in lines) for i in range(len(cols))]
    for ln in lines:
        print("  ".join(s.ljust(w) for s, w in zip(ln, widths)))
    for s in b.skipped:
        print("skipped:", json.dumps(s))


def main() -> int:
    args = parse_args()
    import torch
    if not torch.cuda.is_available() and not args.smoke_cpu:
        print("no CUDA device: nothing to benchmark")
        return 0
    try:
        import triton
        import triton.testing  # noqa: F401
    except ImportError as e:
        print(f"triton not importable ({e}): nothing to benchmark")
        return 0
    t0 = time.monotonic()
    b = Bench(args)
    device_name = torch.cuda.get_device_name() if b.cuda else "cpu (smoke run)"
    cfg = SMOKE if args.smoke_cpu else CHECK if args.check else QUICK if args.quick else FULL
    print(f"{device_name}: copy bandwidth {b.copy_gbps:.0f} GB/s", flush=True)
    fns = {"attention": bench_attention, "norm": bench_norm, "norm_modulate": bench_norm_modulate,
           "rope": bench_rope, "swiglu": bench_swiglu, "cross_entropy": bench_cross_entropy}
    order = [o for o in OPS if o in args.ops]

    def write(complete: bool) -> dict:
        result = {"device": device_name, "torch": torch.__version__, "triton": triton.__version__,
                  "quick": args.quick, "check": args.check, "complete": complete, "copy_bandwidth_gbps": round(b.copy_gbps, 1),
                  "seconds": round(time.monotonic() - t0, 1), "auto_triton": auto_triton(b.rows),
                  "rows": b.rows, "skipped": b.skipped,
                  "notes": {"attention_flops": "4*B*H*L*L*D fwd (/2 causal); fwd+bwd = 3.5x fwd",
                            "bytes": "ideal traffic: inputs read once, outputs written once",
                            "cross_entropy_flops": "model flops 2TDV fwd, 6TDV fwd+bwd"}}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.out)
        return result

    # `timeout` sends SIGTERM: finish with the rows measured so far instead of losing them.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    complete = False
    try:
        for i, op in enumerate(order):
            if b.deadline is not None:
                left = b.deadline - time.monotonic()
                share = WEIGHTS[op] / sum(WEIGHTS[o] for o in order[i:])
                b.op_deadline = time.monotonic() + max(0.0, left) * share
            t_op = time.monotonic()
            fns[op](b, cfg)
            print(f"[{op}: {time.monotonic() - t_op:.0f} s]", flush=True)
            write(False)  # partial results survive a later hang
        complete = True
    except KeyboardInterrupt:
        print("interrupted: writing the rows measured so far", flush=True)
    finally:
        print_table(b)
        result = write(complete)
        print(f"wrote {args.out}; auto_triton (Triton faster fwd+bwd at every size): {result['auto_triton']}")
    return 0 if complete else 130


if __name__ == "__main__":
    sys.exit(main())
