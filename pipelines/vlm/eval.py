"""Evaluate a vlm run on the held-out synthetic VQA split.

Every question of the first --num held-out images is asked alone ("<image>\\n" + question) and the
greedy answer compared with the reference by exact match (case and surrounding punctuation
ignored); accuracy is reported per question type (colour, shape, count, position). The first
--captions images are also captioned (the align stage's prompt) into eval_captions.jsonl, and a
clip stage of the run gets its zero-shot accuracy printed. Results go to eval.json in the run.

  python -m pipelines.vlm.eval --run RUN_DIR [--shards SPEC] [--num N] [--captions N]

RUN_DIR is a stage's directory or a staged run's top directory (its last VLM stage is evaluated).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time

import torch

from common.cli import run_cli
from common.config import ConfigError, from_yaml_file
from common.run import check_run_dir, load_run, write_eval
from pipelines.vlm import clip as clip_stage
from common.data.images import image_bytes
from common.data.shards import iter_samples
from pipelines.vlm.components import answer, clip_zero_shot
from pipelines.vlm.config import VLMConfig
from pipelines.vlm.spec import SPEC


def stage_dirs(run: str) -> dict[str, str]:
    """{stage name: run directory} of a run: a staged run's stages that have started, or the run itself."""
    cfg = from_yaml_file(VLMConfig, check_run_dir(run))
    if not cfg.stages:
        return {cfg.stage.name: run}
    out = {p.name: os.path.join(run, p.name) for p in cfg.stages}
    return {k: v for k, v in out.items() if os.path.isfile(os.path.join(v, "config.yaml"))}


def last_vlm_stage(run: str) -> str:
    dirs = [d for name, d in stage_dirs(run).items() if name != "clip"]
    if not dirs:
        raise ConfigError(f"{run} has no trained VLM stage (align, instruct or full) yet")
    return dirs[-1]


def normalise(text: str) -> str:
    return re.sub(r"[\s.!?,;:]+$", "", text.strip().lower())


def questions(shards: str, num: int) -> tuple[list[tuple], list[tuple]]:
    """([(image bytes, question, answer, type)], [(image bytes, caption)]) of the first num samples."""
    qa, caps = [], []
    for raw in iter_samples(shards):
        if len(caps) >= num:
            break
        meta = json.loads(raw["json"]) if "json" in raw else {}
        img = image_bytes(raw)
        if img is None or not meta.get("qa"):
            continue
        qa += [(img, q["question"], q["answer"], q["type"]) for q in meta["qa"]]
        caps.append((img, raw["txt"].decode("utf-8").strip() if "txt" in raw else ""))
    return qa, caps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines.vlm.eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="run directory (a stage's, or a staged run's top directory)")
    p.add_argument("--shards", default=None, help="held-out shards (default: the run's data.eval_shards)")
    p.add_argument("--num", type=int, default=256, help="held-out images whose questions are asked (default 256)")
    p.add_argument("--captions", type=int, default=16, help="held-out images captioned into eval_captions.jsonl (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="longest answer (default 16)")
    args = p.parse_args(argv)
    if args.num < 1:
        raise ConfigError("--num must be >= 1")
    run = last_vlm_stage(args.run)
    comp, meta = load_run(SPEC, run)
    shards = args.shards or comp.cfg.data.eval_shards
    qa, caps = questions(shards, args.num)
    if not qa:
        raise ConfigError(f"the held-out shards {shards} carry no VQA questions (json qa); eval needs "
                          "python -m data.synth --vqa shards")
    t0 = time.perf_counter()
    got = answer(comp, comp.model, [q[0] for q in qa], [q[1] for q in qa], max_new_tokens=args.max_new_tokens)
    per_type: dict[str, list[int]] = {}
    for (_, _, ref, kind), a in zip(qa, got):
        per_type.setdefault(kind, []).append(int(normalise(a) == normalise(ref)))
    result = {"step": meta["step"], "checkpoint": meta["path"], "stage": comp.cfg.stage.name, "shards": shards,
              "n_images": len(caps),
              "n_questions": len(qa), "accuracy": {k: sum(v) / len(v) for k, v in sorted(per_type.items())},
              "counts": {k: len(v) for k, v in sorted(per_type.items())},
              "overall": sum(sum(v) for v in per_type.values()) / len(qa)}
    split = "held-out" if shards == comp.cfg.data.eval_shards else shards
    lines = [f"eval on {len(qa)} {split} questions about {len(caps)} images (stage {comp.cfg.stage.name}, "
             f"step {meta['step']}, {time.perf_counter() - t0:.0f} s): "
             + ", ".join(f"{k} {v:.1%}" for k, v in result["accuracy"].items()) + f"; overall {result['overall']:.1%}"]
    if args.captions > 0 and caps:
        caps = caps[:args.captions]
        prompt = comp.cfg.stage.caption_prompt
        said = answer(comp, comp.model, [c[0] for c in caps], [prompt] * len(caps), max_new_tokens=48)
        path = os.path.join(args.run, "eval_captions.jsonl")
        with open(path, "w") as f:
            for (_, ref), text in zip(caps, said):
                f.write(json.dumps({"caption": text, "reference": ref}) + "\n")
        lines.append(f"{len(caps)} captions -> {path}")
    clip_dir = stage_dirs(args.run).get("clip")
    if clip_dir:
        ccomp, cmeta = load_run(SPEC, clip_dir)
        zs = clip_zero_shot(ccomp, ccomp.model, shards, args.num, torch.device("cpu"))
        result["clip_zero_shot"] = zs
        lines.append(f"clip stage (step {cmeta['step']}): {clip_stage.format_zero_shot(zs)}")
    write_eval(args.run, result)
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    run_cli(main)
