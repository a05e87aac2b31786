"""Train a vision-language model: CLIP stage 0, then ViT + projector + Llama in stages.

  python -m pipelines.vlm.train --config pipelines/vlm/configs/tiny.yaml [key=value ...]
  torchrun --nproc_per_node 4 -m pipelines.vlm.train --config ... parallel.tp=2   (LM: FSDP 2 x TP 2)

With `stages` in the config (tiny.yaml: clip, align, instruct) the stages run one after another,
each in run.dir/<stage> and each starting from the previous one's final weights; a stage whose
run directory already holds its final checkpoint is not trained again, and an interrupted stage
resumes from its latest checkpoint. Without `stages`, one stage (stage.name) runs in run.dir.

Parallel layouts (parallel.*): the LM takes tp (+ sequence_parallel), cp with cp_mode
ulysses|ring|hybrid over packed rows, pp (packing.rows fixed); the vision tower is FSDP-sharded
over all ranks of a stage. The clip stage is data parallel only.
"""
from __future__ import annotations

import copy
import os

from common.cli import run_cli
from common.config import ConfigError, parse_cli, to_yaml
from common.run import train
from pipelines.vlm.config import VLMConfig
from pipelines.vlm.spec import SPEC


def stage_configs(cfg: VLMConfig) -> list[VLMConfig]:
    """One config per stage of cfg.stages (or [cfg] without stages)."""
    if not cfg.stages:
        return [cfg]
    out, previous = [], cfg.stage.init
    for plan in cfg.stages:
        s = copy.deepcopy(cfg)
        s.stages = []
        s.stage.name = plan.name
        s.stage.init = previous
        s.run.dir = os.path.join(cfg.run.dir, plan.name)
        s.train.steps = plan.steps
        s.optim.lr = plan.lr
        if plan.micro_batch_size:
            s.data.micro_batch_size = plan.micro_batch_size
        if plan.warmup_steps >= 0:
            s.optim.warmup_steps = plan.warmup_steps
        if s.train.ckpt_every != "auto":
            s.train.ckpt_every = min(s.train.ckpt_every, plan.steps)
        s.validate()
        out.append(s)
        previous = s.run.dir
    return out


def main(argv=None) -> int:
    cfg = parse_cli(VLMConfig, argv, "python -m pipelines.vlm.train", SPEC.description)
    stages = stage_configs(cfg)
    if cfg.stages:
        if any(s.stage.name == "clip" for s in stages[1:]):
            raise ConfigError("stages: clip can only be the first stage")
        os.makedirs(cfg.run.dir, exist_ok=True)
        if not cfg.tokenizer.path and not cfg.lm.hf_path and any(s.stage.name != "clip" for s in stages):
            # One tokenizer for every stage, in the top-level run directory.
            from pipelines.vlm.components import resolve_tokenizer
            resolve_tokenizer(cfg, int(os.environ.get("RANK", "0")) == 0)
            for s in stages:
                s.tokenizer.path = cfg.tokenizer.path
        if int(os.environ.get("RANK", "0")) == 0:
            with open(os.path.join(cfg.run.dir, "config.yaml"), "w") as f:  # what eval/sample/export read
                f.write(to_yaml(cfg))
    for i, s in enumerate(stages):
        if len(stages) > 1 and int(os.environ.get("RANK", "0")) == 0:
            print(f"=== stage {i + 1}/{len(stages)}: {s.stage.name} ({s.train.steps} steps) in {s.run.dir}", flush=True)
        code = train(SPEC, cfg=s)
        if code:  # stopped by train.save_on_signal: the same command resumes this stage
            return code
    return 0


if __name__ == "__main__":
    run_cli(main)
