"""Training throughput and MFU of the text2image DiT at DiT-XL/2 size on one GPU, per precision.

The model is the pipeline's own class (pipelines/text2image/model.py, preset "XL": hidden 1152,
depth 28, 16 heads, patch 2 on 32x32x4 latents = 256 tokens, cross-attention to 77 text tokens of
width 768), without the VAE and the text tower: each step feeds random latents and random text
features of the shapes those would produce (a key-padding mask with caption lengths 8..77, as the
tower's tokenizer gives). One step is the pipeline's: rectified-flow interpolation x_t, velocity
target, MSE, backward, global-norm clip (1.0), AdamW (common/optim.py, fp32 master weights and state).

Variants, each timed after warmup on the same inputs in the same process:
  bf16             autocast bf16 forward + loss, fp32 master weights, eager
  compile          bf16 + torch.compile per block (common/parallel/compile.py: the 28 identical
                   blocks share one graph; embeddings and the final layer stay eager), as
                   parallel.compile=true trains
  fp8_tensorwise   torchao float8 training of the linears the roofline picks
  fp8_rowwise      (common.precision.fp8.convert_fp8 with rows from
                   common.precision.convert.record_linear_rows), then compiled per block like
                   `compile` (torchao's float8 casts need inductor to fuse them)
Each row carries its ratio to bf16 (ratio_to_bf16) and to compile (ratio_to_compile), on samples/s
(= the steps/s ratio at equal batch; a variant that had to halve its batch on OOM says so).

FLOPs: the model's own counter, DiT.flops_per_sample (pipelines/text2image/model.py: matmuls and
attention, 2 per multiply-add, norms and elementwise ignored), times 3 for forward + backward: the
count the trainer's MFU uses. MFU is against the published dense bf16 peak of the device
(common.precision.hardware), for the fp8 variants too, since the targets are stated that way; the
fp8 rows add mfu_vs_fp8_peak.

  python bench/gpu_train_bench.py [--batch 128] [--time-budget 150] [--out FILE.json]
  python bench/gpu_train_bench.py --device cpu --size tiny     # fp32, seconds: exercises the code
                                                               # paths (fp8 converted with force=True)
With --profile-steps N each variant also profiles N steps after its timing (torch.profiler) and
records the device time per step by kernel category (GEMM, fp8 GEMM, attention, Triton/inductor,
optimizer/reductions, other elementwise) with the top kernels: where, say, an fp8 step's time goes.
The JSON is rewritten after every variant, so a run killed by a timeout keeps what it measured.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time
import traceback
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VARIANTS = ("bf16", "compile", "fp8_tensorwise", "fp8_rowwise")
SIZES = {
    # DiT-XL/2 on 256 px images through an 8x VAE (configs/xl.yaml), text as configs/xl.yaml's tower
    "xl": dict(preset="XL", overrides=dict(img_size=32, in_channels=4, text_dim=768, text_len=77), batch=128),
    # seconds on a CPU: the code paths only
    "tiny": dict(preset="tiny", overrides=dict(img_size=16, in_channels=4, patch_size=4, hidden=64, depth=2, heads=2,
                                               text_dim=32, text_len=8), batch=4),
}
FLOPS_SOURCE = ("DiT.flops_per_sample (pipelines/text2image/model.py: matmuls + attention, 2 per MAC) x 3 "
                "for forward + backward, as the trainer's MFU counts")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="cuda (default when available) | cpu")
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help="xl (default on cuda) | tiny (default on cpu)")
    ap.add_argument("--batch", type=int, default=None, help="micro-batch (default: 128 for xl, halved on OOM)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per variant (the compile happens here)")
    ap.add_argument("--steps", type=int, default=20, help="at most this many timed steps per variant")
    ap.add_argument("--min-steps", type=int, default=3, help="timed steps even past the time budget")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds for all variants; the timed loop of each stops at its share")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after timing, profile this many more steps per variant (torch.profiler) and record where "
                         "the device time goes: per kernel category and the top kernels (row['profile'])")
    ap.add_argument("--no-fp8-compile", action="store_true", help="time the fp8 variants eagerly")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend of the compiled variants (the CPU dry run uses aot_eager: the "
                         "script's path without minutes of C++ code generation)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "gpu_train_bench.json"))
    args = ap.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}; choose from {VARIANTS}")
    return args


class Bench:
    def __init__(self, args):
        import torch

        from pipelines.text2image.model import DiT, dit_config
        self.torch, self.args = torch, args
        self.dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.cuda = self.dev.type == "cuda"
        self.size = args.size or ("xl" if self.cuda else "tiny")
        spec = SIZES[self.size]
        self.cfg = dit_config(spec["preset"], **spec["overrides"])
        self.DiT = DiT
        self.batch = args.batch or spec["batch"]
        self.compute_dtype = torch.bfloat16 if self.cuda else torch.float32  # CPUs here have no bf16 units
        from common.precision.hardware import detect
        self.hw = detect(self.dev)
        self.peak_bf16 = self.hw.peak("bf16") if self.hw else None
        self.peak_fp8 = self.hw.peak_flops.get("fp8") if self.hw else None
        self.t0 = time.monotonic()
        self.deadline = None if args.time_budget is None else self.t0 + args.time_budget
        self.rows: list[dict] = []
        self._inputs = None
        with torch.device("meta"):  # sizes only: no memory, no init time
            probe = DiT(self.cfg)
        self.params = sum(p.numel() for p in probe.parameters())
        self.flops_fwd = probe.flops_per_sample(text_len=self.cfg.text_len)
        del probe

    # ---- inputs and one training step --------------------------------------------------------
    def inputs(self, batch: int):
        torch = self.torch
        if self._inputs is None or self._inputs[0].shape[0] != batch:
            self._inputs = None
            g = torch.Generator(device="cpu").manual_seed(0)
            c, s, lt = self.cfg.in_channels, self.cfg.img_size, self.cfg.text_len
            x0 = torch.randn(batch, c, s, s, generator=g)
            noise = torch.randn(batch, c, s, s, generator=g)
            t = torch.sigmoid(torch.randn(batch, generator=g))  # logit-normal timesteps
            ctx = torch.randn(batch, lt, self.cfg.text_dim, generator=g)
            lengths = torch.randint(min(8, lt), lt + 1, (batch,), generator=g)
            mask = torch.arange(lt)[None, :] < lengths[:, None]
            self._inputs = tuple(x.to(self.dev) for x in (x0, noise, t, ctx, mask))
        return self._inputs

    def autocast(self):
        import contextlib
        if self.compute_dtype == self.torch.float32:
            return contextlib.nullcontext()
        return self.torch.autocast(self.dev.type, dtype=self.compute_dtype)

    def forward_loss(self, model, batch: int):
        x0, noise, t, ctx, mask = self.inputs(batch)
        tb = t.view(-1, 1, 1, 1)
        x_t = (1 - tb) * x0 + tb * noise
        with self.autocast():
            pred = model(x_t, t, ctx, mask)
            return self.torch.nn.functional.mse_loss(pred.float(), noise - x0)

    def train_step(self, model, opt, params, batch: int):
        loss = self.forward_loss(model, batch)
        loss.backward()
        self.torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    # ---- variants ----------------------------------------------------------------------------
    def build(self, variant: str, batch: int, row: dict):
        """Fresh model (same init every variant), converted / compiled as the variant says."""
        torch = self.torch
        from common.optim import build_optimizer
        torch.manual_seed(0)
        with torch.device(self.dev):  # initialised where it trains (an XL init on the CPU takes seconds)
            model = self.DiT(self.cfg)
        compiled = variant == "compile" or (variant.startswith("fp8") and not self.args.no_fp8_compile)
        if variant.startswith("fp8"):
            recipe = variant.split("_", 1)[1]
            # Imported here: the fp8 module is optional (torchao); its absence skips only these rows.
            from common.precision.convert import record_linear_rows
            from common.precision.fp8 import convert_fp8

            def run_forward():
                with torch.no_grad():
                    self.forward_loss(model, batch)

            rows = record_linear_rows(model, run_forward)
            report = convert_fp8(model, recipe, rows=rows, spec=self.hw, fsdp_all_gather=False, emulate=not self.cuda,
                                 force=not self.cuda)
            row["fp8_recipe"] = recipe
            row["fp8_forced"] = not self.cuda
            row["fp8_report"] = _jsonable(report)
        if compiled:
            from common.parallel.compile import compile_blocks
            compile_blocks(model.blocks, backend=self.args.compile_backend)
            row["compile"] = (f"per block (common.parallel.compile.compile_blocks, {self.args.compile_backend}, "
                              "dynamic=False)")
        optim_cfg = SimpleNamespace(lr=1e-4, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0)
        opt = build_optimizer(model, optim_cfg)
        params = [p for p in model.parameters() if p.requires_grad]
        return model, opt, params

    def run_variant(self, variant: str, share_deadline: float | None) -> dict:
        torch = self.torch
        row = {"variant": variant, "status": "ok", "compute_dtype": str(self.compute_dtype).replace("torch.", ""),
               "compile": None}
        batch = self.batch
        while True:
            model = opt = params = None
            try:
                row.pop("reason", None)
                if self.cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                t_build = time.monotonic()
                model, opt, params = self.build(variant, batch, row)
                for _ in range(self.args.warmup):
                    self.train_step(model, opt, params, batch)
                self.sync()
                row["warmup_s"] = round(time.monotonic() - t_build, 2)  # build + conversion + compile + warmup
                n, t = 0, time.perf_counter()
                while n < self.args.steps:
                    loss = self.train_step(model, opt, params, batch)
                    n += 1
                    if n >= self.args.min_steps and share_deadline is not None and time.monotonic() > share_deadline:
                        break
                self.sync()
                dt = time.perf_counter() - t
                row.update(batch=batch, steps_timed=n, step_ms=round(dt / n * 1e3, 2),
                           steps_per_s=round(n / dt, 4), samples_per_s=round(n * batch / dt, 2),
                           loss_last=float(loss.detach()))
                achieved = 3 * self.flops_fwd * batch * n / dt
                row["tflops_per_s"] = round(achieved / 1e12, 2)
                if self.peak_bf16:
                    row["mfu"] = round(achieved / self.peak_bf16, 4)
                    if variant.startswith("fp8") and self.peak_fp8:
                        row["mfu_vs_fp8_peak"] = round(achieved / self.peak_fp8, 4)
                if self.cuda:
                    row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
                if self.args.profile_steps > 0:
                    row["profile"] = self.profile(model, opt, params, batch, self.args.profile_steps)
                if batch != self.batch:
                    row["note"] = f"batch halved from {self.batch} after out-of-memory"
                return row
            except torch.OutOfMemoryError:
                self._inputs = None
                if batch <= 1:
                    row.update(status="failed", reason="out of memory at batch 1")
                    return row
                print(f"[{variant}] out of memory at batch {batch}: halving", flush=True)
                batch //= 2
                if variant == "bf16":  # later variants start at the batch that fits
                    self.batch = batch
            except ImportError as e:
                row.update(status="skipped", reason=f"{type(e).__name__}: {e}"[:400])
                return row
            except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others
                row.update(status="failed", reason=f"{type(e).__name__}: {e}"[:600],
                           traceback=traceback.format_exc()[-2000:])
                return row
            finally:
                model = opt = params = None  # noqa: F841 - drop the references before the next build
                gc.collect()
                if self.cuda:
                    torch.cuda.empty_cache()

    def profile(self, model, opt, params, batch: int, steps: int) -> dict:
        """Device time per step by kernel category, and the top kernels: where a variant's step goes."""
        from torch.profiler import ProfilerActivity, profile

        from common.metrics import operator_times
        acts = [ProfilerActivity.CUDA] if self.cuda else [ProfilerActivity.CPU]
        with profile(activities=acts) as prof:
            for _ in range(steps):
                self.train_step(model, opt, params, batch)
            self.sync()
        kernels = [(name, ms, calls, kernel_category(name))
                   for name, ms, calls in operator_times(prof.key_averages(), steps, device=self.cuda)]
        by_cat: dict[str, float] = {}
        for _, ms, _, cat in kernels:
            by_cat[cat] = by_cat.get(cat, 0.0) + ms
        total = sum(by_cat.values())
        return {"steps": steps, "unit": "ms per step" + ("" if self.cuda else " (CPU ops)"),
                "total_ms": round(total, 2),
                "by_category_ms": {k: round(v, 2) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
                "top": [{"name": n[:160], "ms": round(ms, 3), "calls": c, "category": cat}
                        for n, ms, c, cat in kernels[:15]]}

    def ratios(self):
        by = {r["variant"]: r for r in self.rows if r.get("status") == "ok"}
        for r in self.rows:
            if r.get("status") != "ok":
                continue
            for base in ("bf16", "compile"):
                if base in by and r["variant"] != base:
                    r["ratio_to_" + base] = round(r["samples_per_s"] / by[base]["samples_per_s"], 3)

    def result(self, complete: bool) -> dict:
        torch = self.torch
        c = self.cfg
        return {
            "device": torch.cuda.get_device_name(self.dev) if self.cuda else "cpu",
            "torch": torch.__version__, "size": self.size, "complete": complete,
            "seconds": round(time.monotonic() - self.t0, 1),
            "model": {"class": "pipelines.text2image.model.DiT", "hidden": c.hidden, "depth": c.depth,
                      "heads": c.heads, "patch": c.patch_size, "latent": [c.in_channels, c.img_size, c.img_size],
                      "tokens": c.num_tokens, "text_len": c.text_len, "text_dim": c.text_dim, "params": self.params},
            "flops_fwd_per_sample": self.flops_fwd, "flops_source": FLOPS_SOURCE,
            "peak_bf16_flops": self.peak_bf16, "peak_fp8_flops": self.peak_fp8,
            "peak_source": f"common.precision.hardware ({self.hw.name})" if self.hw else None,
            "mfu_note": "mfu is against the dense bf16 peak for every variant (fp8 too: the targets are stated "
                        "that way); fp8 rows add mfu_vs_fp8_peak",
            "ratio_note": "ratio_to_* compares samples/s (steps/s at equal batch) with that variant in this run",
            "variants": self.rows,
        }


# Kernel-name fragments -> category, first match wins. Inductor's kernels come first: they are named
# after the ops they fuse, "_scaled_mm" included when they compute an fp8 GEMM's casts and scales.
# cuBLAS's Hopper GEMMs are "nvjet_sm90_*"; its fp8 ones carry a q in the tile kind ("qqtst",
# "qrtst"; bf16 is "tst"), seen only in the fp8 variants on an H200 with torch 2.11.
CATEGORIES = (
    ("triton / inductor", ("triton_", "triton::")),
    ("fp8 gemm", ("f8f8", "e4m3", "e5m2", "scaled_mm", "_qqtst", "_qrtst", "_rqtst", "_rrtst")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "addmm", "aten::mm", "aten::bmm")),
    ("attention", ("flash", "fmha", "attention", "cudnn", "sdpa")),
    ("optimizer / norms / reductions", ("multi_tensor", "foreach", "reduce", "norm")),
)


def kernel_category(name: str) -> str:
    low = name.lower()
    for cat, frags in CATEGORIES:
        if any(f in low for f in frags):
            return cat
    return "other elementwise / copies"


def _jsonable(obj):
    """The conversion report as JSON: dataclass, dict, list or its str()."""
    import dataclasses
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    try:
        json.dumps(obj)
        return obj
    except TypeError:
        if isinstance(obj, dict):
            return {str(k): _jsonable(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [_jsonable(v) for v in obj]
        return str(obj)[:2000]


def print_table(res: dict):
    cols = ["variant", "status", "batch", "steps_per_s", "samples_per_s", "step_ms", "tflops_per_s", "mfu",
            "ratio_to_bf16", "ratio_to_compile", "peak_mem_gib", "warmup_s"]
    lines = [cols] + [[str(r.get(k, "")) for k in cols] for r in res["variants"]]
    widths = [max(len(ln[i]) for ln in lines) for i in range(len(cols))]
    for ln in lines:
        print("  ".join(s.ljust(w) for s, w in zip(ln, widths)))
    for r in res["variants"]:
        if r.get("reason"):
            print(f"{r['variant']}: {r['status']}: {r['reason']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    b = Bench(args)
    m = b.cfg
    print(f"{b.dev} | DiT ({b.size}) hidden {m.hidden} depth {m.depth} heads {m.heads} patch {m.patch_size}, "
          f"{m.num_tokens} tokens + {m.text_len} text | {b.params / 1e6:.1f}M params | batch {b.batch} | "
          f"{3 * b.flops_fwd / 1e9:.3g} GFLOP per sample-step | peak bf16 "
          + (f"{b.peak_bf16 / 1e12:.0f} TFLOP/s" if b.peak_bf16 else "unknown (no MFU)"), flush=True)

    def write(complete: bool) -> dict:
        b.ratios()
        res = b.result(complete)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp, args.out)
        return res

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    complete = False
    res = None
    try:
        for i, v in enumerate(args.variants):
            share = None
            if b.deadline is not None:
                left = b.deadline - time.monotonic()
                if left <= 0:
                    b.rows.append({"variant": v, "status": "skipped", "reason": "time budget"})
                    continue
                share = time.monotonic() + left / (len(args.variants) - i)
            t = time.monotonic()
            row = b.run_variant(v, share)
            b.rows.append(row)
            print(f"[{v}: {row['status']} in {time.monotonic() - t:.0f} s] "
                  + (f"{row.get('samples_per_s')} samples/s, mfu {row.get('mfu')}" if row["status"] == "ok"
                     else row.get("reason", "")), flush=True)
            if row.get("profile"):
                p = row["profile"]
                print(f"[{v}: profile, {p['unit']}] total {p['total_ms']}: "
                      + ", ".join(f"{k} {ms}" for k, ms in p["by_category_ms"].items()), flush=True)
            write(False)
        complete = True
    except KeyboardInterrupt:
        print("interrupted: writing the variants measured so far", flush=True)
    finally:
        res = write(complete)
        print_table(res)
        print(f"wrote {args.out}")
    return 0 if complete else 130


if __name__ == "__main__":
    sys.exit(main())
