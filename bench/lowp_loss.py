"""Low-precision training numerics: the same text2image run for N steps under each precision recipe,
compared by the mean loss of the last 20 steps against a baseline recipe.

Recipes: fp32, bf16 (autocast; CUDA only by default: CPU cores have no bf16 units), fp8 tensorwise
and rowwise (torchao; GEMMs emulated on CPU), int8 (torch._int_mm), each with every candidate linear
converted (precision.roofline=none): those of the transformer blocks (the default,
precision.convert=blocks) or all of them. Same samples and noise in every run, so the loss gap is
the recipe's numerics plus the divergence of two trajectories; the fp32-vs-bf16 gap on CUDA shows
how far two precisions drift apart without any fp8 (0.93% after 200 B-sized steps on an H200).
--seeds runs every recipe once per seed and pairs each with the baseline of its seed: a bias keeps
its sign across seeds, divergence does not. Step time is printed, but on CPU (emulation, no fp8
units) it says nothing about a GPU, and on CUDA the runs are eager (no compile), so
gpu_train_bench.py is the speed measurement.

  python bench/lowp_loss.py [--steps 200] [--config pipelines/text2image/configs/tiny.yaml]
      [--size 32] [--recipes fp32,...] [--baseline fp32] [--seeds 0,1,...] [--set key=value ...]
      [--parallel N] [--json PATH]

On CPU the defaults are the tiny demo config, fp32 as the baseline and the fp8/int8 recipes; on
CUDA fp32, bf16 (the baseline) and both fp8 scalings, all at once (--parallel: one eager run of
the B-sized config keeps an H200 busy for about a fifth of its step, the rest is host time). A
recipe that fails is recorded with its error and the others still run; the JSON is rewritten as
each recipe ends, so a run cut by a time limit keeps the finished ones.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The block linears are converted by default (precision.convert=blocks); "all linears" adds the
# timestep/caption MLPs, the shared adaLN projection and the output layer.
RECIPES = {"fp32": ["precision.compute=fp32"], "bf16": ["precision.compute=bf16"],
           "fp8 tensorwise": ["precision.fp8=tensorwise"], "fp8 rowwise": ["precision.fp8=rowwise"],
           "int8": ["precision.int8=true"],
           "fp8 tensorwise, all linears": ["precision.fp8=tensorwise", "precision.convert=all"],
           "fp8 rowwise, all linears": ["precision.fp8=rowwise", "precision.convert=all"],
           "int8, all linears": ["precision.int8=true", "precision.convert=all"]}
DEFAULT_RECIPES = {
    "cpu": ["fp32", "fp8 tensorwise", "fp8 rowwise", "int8", "fp8 tensorwise, all linears",
            "fp8 rowwise, all linears", "int8, all linears"],
    # fp32 last: without tensor cores it is the slowest run, the one a time limit cuts first when
    # --parallel is below the number of recipes
    "cuda": ["bf16", "fp8 tensorwise", "fp8 rowwise", "fp32"],
}
LAST = 20  # steps averaged for the final loss


class Run:
    """One recipe's training run as a subprocess writing its own log and metrics."""

    def __init__(self, name: str, seed: int | None, args, data: str, work: str):
        self.name, self.seed, self.steps = name, seed, args.steps
        self.label = name if seed is None else f"{name} (seed {seed})"
        self.run_dir = os.path.join(work, name.replace(" ", "_").replace(",", "")
                                    + ("" if seed is None else f"_seed{seed}"))
        cmd = [sys.executable, "-m", "pipelines.text2image.train", "--config", args.config,
               f"run.dir={self.run_dir}", f"data.train_shards={data}/train", f"data.eval_shards={data}/heldout",
               f"train.steps={self.steps}", "train.log_every=1", f"train.ckpt_every={self.steps}", "sample.num=0",
               "train.progress=false", "precision.roofline=none", *args.set, *RECIPES[name],
               *([] if seed is None else [f"run.seed={seed}"])]
        self.log_path = self.run_dir + ".log"
        self.t0 = time.time()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def result(self) -> dict:
        with open(self.log_path, errors="replace") as f:
            out = f.read()
        if self.proc.returncode:
            tail = out[-3000:].strip()
            return {"status": "failed", "error": tail.splitlines()[-1] if tail else f"rc {self.proc.returncode}",
                    "log_tail": tail}
        with open(os.path.join(self.run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
        input_frac = [r["input_frac"] for r in rows if "input_frac" in r]
        converted = next((line for line in out.splitlines() if "linears converted" in line), "")
        last = [losses[s] for s in range(self.steps - LAST + 1, self.steps + 1) if s in losses]
        sps = [r["samples_per_s"] for r in rows if "samples_per_s" in r]
        return {"status": "ok", "final_loss": sum(last) / len(last),
                "median_samples_per_s": statistics.median_high(sps),
                "median_input_frac": statistics.median_high(input_frac) if input_frac else None,
                "converted": converted, "wall_s": round(time.time() - self.t0, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--config", default="pipelines/text2image/configs/tiny.yaml")
    ap.add_argument("--size", type=int, default=32, help="synthetic image side (match the config's model.image_size)")
    ap.add_argument("--count", type=int, default=2048, help="synthetic training samples (the loader repeats them)")
    ap.add_argument("--recipes", default=None,
                    help=f"comma-separated, of: {', '.join(RECIPES)} (default: per device, see the docstring)")
    ap.add_argument("--baseline", default=None, help="recipe the others are compared with (default fp32 on CPU, bf16 on CUDA)")
    ap.add_argument("--set", nargs="*", default=[], help="extra config overrides for every run (key=value)")
    ap.add_argument("--data", default="", help="synthetic shards (default: generated into a temp dir)")
    ap.add_argument("--parallel", type=int, default=None,
                    help="runs (recipe x seed) at once (default 1 on CPU; all of them on CUDA, where one run alone is far "
                         "from using the GPU)")
    ap.add_argument("--seeds", default="",
                    help="comma-separated run.seed values: every recipe runs once per seed, each compared with the "
                         "baseline's run of the same seed (default: the config's seed, one run per recipe)")
    ap.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "lowp_loss.json"))
    args = ap.parse_args(argv)
    import torch  # only to pick the device's defaults; the runs are subprocesses

    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = args.recipes.split(",") if args.recipes else DEFAULT_RECIPES[device]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        ap.error(f"unknown recipe(s) {unknown}; known: {', '.join(RECIPES)}")
    baseline = args.baseline or ("bf16" if device == "cuda" else "fp32")
    if baseline not in names:
        ap.error(f"--baseline {baseline} is not among the recipes {names}")
    names = [baseline] + [n for n in names if n != baseline]
    out = {"device": device, "config": args.config, "steps": args.steps, "baseline": baseline, "set": args.set,
           "results": {}}

    def write():
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)

    try:
        seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [None]
    except ValueError:
        ap.error(f"--seeds {args.seeds!r} must be comma-separated integers, e.g. 0,1,2")
    if len(set(seeds)) != len(seeds):
        ap.error(f"--seeds {args.seeds!r} repeats a seed")
    out["seeds"] = seeds if args.seeds else None
    runs = {}  # recipe -> {seed: result}

    def aggregate():
        ref = runs.get(baseline, {})
        out["results"] = {}  # in recipe order, the baseline first
        for name in names:
            per = runs.get(name)
            if not per:
                continue
            for seed, r in per.items():  # the baseline of the same seed may finish after the others
                if r["status"] == "ok" and ref.get(seed, {}).get("status") == "ok":
                    r["loss_vs_baseline"] = r["final_loss"] / ref[seed]["final_loss"] - 1
            if len(seeds) == 1:
                out["results"][name] = next(iter(per.values()))
                continue
            ok = [r for r in per.values() if r["status"] == "ok"]
            failed = [r for r in per.values() if r["status"] == "failed"]
            agg = {"status": "ok" if len(ok) == len(seeds) else "failed" if failed else "incomplete",
                   "seeds": {str(k): v for k, v in per.items()}}
            if ok:
                agg["final_loss"] = sum(r["final_loss"] for r in ok) / len(ok)
                agg["median_samples_per_s"] = statistics.median_high([r["median_samples_per_s"] for r in ok])
                agg["converted"] = ok[0]["converted"]
                gaps = [r["loss_vs_baseline"] for r in ok if "loss_vs_baseline" in r]
                if gaps:  # paired by seed: a bias keeps its sign, divergence between runs does not
                    agg["loss_vs_baseline"] = sum(gaps) / len(gaps)
                    agg["loss_vs_baseline_range"] = [min(gaps), max(gaps)]
            if failed:
                agg["error"] = failed[0]["error"]
            out["results"][name] = agg

    with tempfile.TemporaryDirectory() as work:
        data = args.data
        if not data:
            data = os.path.join(work, "synth")
            subprocess.run([sys.executable, "-m", "data.synth", "--out", data, "--count", str(args.count),
                            "--heldout-count", "64", "--size", str(args.size), "--no-progress"],
                           cwd=ROOT, check=True, capture_output=True)
        jobs = [(name, seed) for seed in seeds for name in names]
        parallel = max(1, args.parallel or (len(jobs) if device == "cuda" else 1))
        pending, running = list(jobs), []
        while pending or running:
            while pending and len(running) < parallel:
                run = Run(*pending.pop(0), args, data, work)
                print(f"[lowp_loss] {run.label}: {args.steps} steps ...", flush=True)
                running.append(run)
            done = [r for r in running if r.proc.poll() is not None]
            if not done:
                time.sleep(0.5)
                continue
            for run in done:
                running.remove(run)
                runs.setdefault(run.name, {})[run.seed] = run.result()
            aggregate()
            for run in done:
                r = runs[run.name][run.seed]
                print(f"[lowp_loss] {run.label}: " + json.dumps({k: v for k, v in r.items() if k != "log_tail"}),
                      flush=True)
            write()
        write()
    over = "" if len(seeds) == 1 else f", mean over seeds {args.seeds}"
    print(f"\n| recipe ({os.path.basename(args.config)}, {args.steps} steps, {device}) | loss, mean of last {LAST} "
          f"steps{over} | vs {baseline}{' (range over seeds)' if over else ''} | samples/s |\n|---|---|---|---|")
    for name, r in out["results"].items():
        if r["status"] != "ok":
            print(f"| {name} | {r['status']}: {r.get('error', '')[:120]} | | |")
            continue
        gap = "" if name == baseline or "loss_vs_baseline" not in r else f"{100 * r['loss_vs_baseline']:+.2f}%"
        if gap and "loss_vs_baseline_range" in r:
            lo, hi = r["loss_vs_baseline_range"]
            gap += f" ({100 * lo:+.2f}% to {100 * hi:+.2f}%)"
        print(f"| {name} | {r['final_loss']:.4f} | {gap} | {r['median_samples_per_s']:.0f} |")
    return 0 if all(r["status"] == "ok" for r in out["results"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
