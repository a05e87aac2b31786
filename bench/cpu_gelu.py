"""CPU cost of the tanh-approximated GELU (the DiT MLP activation), forward + backward: ATen's
eager kernel, Inductor's code for it as written (tanh), and Inductor's code for the sigmoid form
that common.kernels.gelu_tanh uses under torch.compile on CPU (0.5 (1 + tanh z) = sigmoid(2z)).

Shapes are the MLP hidden activations of the text2image demo (32 x 64 tokens x 512) and of
DiT-S (32 x 256 x 1536). Ratios printed are time / the sigmoid form's; also the largest
difference of each from a float64 reference (the forms are the same function up to fp32
rounding).

  python bench/cpu_gelu.py [--threads 1] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.cpu_attention_keys import best_ms  # noqa: E402
from common.kernels.gelu import gelu_tanh_sigmoid_form  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = (("demo", (32, 64, 512)), ("S", (32, 256, 1536)))


def aten_gelu(x):
    return F.gelu(x, approximate="tanh")


def fwd_bwd(fn, x, grad):
    def step():
        fn(x).backward(grad)
        x.grad = None
    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "cpu_gelu.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    impls = {"eager ATen": aten_gelu, "compiled tanh": torch.compile(aten_gelu, dynamic=False),
             "compiled sigmoid form": torch.compile(gelu_tanh_sigmoid_form, dynamic=False)}
    rows = []
    for name, shape in SHAPES:
        torch.manual_seed(0)
        x = (torch.randn(shape) * 3).requires_grad_()
        grad = torch.randn(shape)
        ref = aten_gelu(x.detach().double())
        calls = 20 if name == "demo" else 3
        ms = {k: best_ms(fwd_bwd(f, x, grad), args.repeats, calls, warmup=2) for k, f in impls.items()}
        with torch.no_grad():
            err = {k: (f(x.detach()).double() - ref).abs().max().item() for k, f in impls.items()}
        base = ms["compiled sigmoid form"]
        rows.append({"shape": name, "dims": list(shape), "ms": ms, "max_abs_err_vs_fp64": err})
        print(f"{name:4} {tuple(shape)} forward + backward: "
              + ", ".join(f"{k} {v:.2f} ms ({v / base:.2f}x, err {err[k]:.1e})" for k, v in ms.items()), flush=True)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"threads": args.threads, "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
