"""Low-precision training on CPU: the tiny text2image demo config for N steps in fp32, fp8
(tensorwise, rowwise; torchao, GEMMs emulated on CPU) and int8 (torch._int_mm), with every
candidate linear converted (precision.roofline=none): those of the transformer blocks (the
default, precision.convert=blocks) or all of them. Same samples and noise in every run, so the
loss gap is the recipe's numerics. Step time on CPU says nothing about a GPU (emulation, no fp8 units); it is
printed so nobody mistakes it for a speed-up.

  python bench/lowp_cpu.py [--steps 200] [--data DIR] [--json bench/results/lowp_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The block linears are converted by default (precision.convert=blocks); "all linears" adds the
# timestep/caption MLPs, the shared adaLN projection and the output layer.
RECIPES = {"fp32": [], "fp8 tensorwise": ["precision.fp8=tensorwise"], "fp8 rowwise": ["precision.fp8=rowwise"],
           "int8": ["precision.int8=true"],
           "fp8 tensorwise, all linears": ["precision.fp8=tensorwise", "precision.convert=all"],
           "fp8 rowwise, all linears": ["precision.fp8=rowwise", "precision.convert=all"],
           "int8, all linears": ["precision.int8=true", "precision.convert=all"]}


def run(name: str, extra: list[str], steps: int, data: str, work: str) -> dict:
    run_dir = os.path.join(work, name.replace(" ", "_"))
    cmd = [sys.executable, "-m", "pipelines.text2image.train", "--config", "pipelines/text2image/configs/tiny.yaml",
           f"run.dir={run_dir}", f"data.train_shards={data}/train", f"data.eval_shards={data}/heldout",
           f"train.steps={steps}", "train.log_every=1", f"train.ckpt_every={steps}", "sample.num=0",
           "train.progress=false", "precision.roofline=none", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    sps = sorted(r["samples_per_s"] for r in rows if "samples_per_s" in r)
    converted = next((line for line in proc.stdout.splitlines() if "linears converted" in line), "")
    return {"final_loss": sum(losses[s] for s in range(steps - 19, steps + 1)) / 20,
            "median_samples_per_s": sps[len(sps) // 2], "converted": converted}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--data", default="", help="synthetic shards (default: generated into a temp dir)")
    ap.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "lowp_cpu.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        data = args.data
        if not data:
            data = os.path.join(work, "synth")
            subprocess.run([sys.executable, "-m", "data.synth", "--out", data, "--count", "2048",
                            "--heldout-count", "64"], cwd=ROOT, check=True, capture_output=True)
        results = {}
        for name, extra in RECIPES.items():
            results[name] = run(name, extra, args.steps, data, work)
            print(f"{name}: {results[name]}", flush=True)
    ref = results["fp32"]["final_loss"]
    print(f"\n| recipe (tiny text2image, {args.steps} steps x 32, CPU) | loss, mean of last 20 steps | vs fp32 | "
          "samples/s (CPU; emulated) |\n|---|---|---|---|")
    for name, r in results.items():
        r["loss_vs_fp32"] = r["final_loss"] / ref - 1
        print(f"| {name} | {r['final_loss']:.4f} | {100 * r['loss_vs_fp32']:+.2f}% | {r['median_samples_per_s']:.0f} |")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"steps": args.steps, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
