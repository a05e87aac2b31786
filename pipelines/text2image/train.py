"""Train a text-to-image DiT.

  python -m pipelines.text2image.train --config pipelines/text2image/configs/tiny.yaml [key=value ...]
  torchrun --nproc_per_node 4 -m pipelines.text2image.train --config ... parallel.tp=2   (FSDP 2 x TP 2)

Parallel layouts (parallel.*): dp_shard/dp_replicate (FSDP, HSDP), tp (+ sequence_parallel),
cp with cp_mode ulysses|ring|hybrid, pp with pp_schedule 1f1b|interleaved|zero_bubble|gpipe,
activation_checkpoint, compile. Their product must equal the number of processes.
"""
from __future__ import annotations

import os

import torch

from common import dist as mdist
from common.cli import run_cli
from common.config import ConfigError, parse_cli
from common.data import StreamingLoader
from common.trainer import Trainer
from pipelines.text2image import components
from pipelines.text2image.config import T2IConfig
from pipelines.text2image.data import ImageDecoder, first_examples
from pipelines.text2image.parallelize import parallelize


def main(argv=None) -> int:
    cfg: T2IConfig = parse_cli(T2IConfig, argv, "python -m pipelines.text2image.train", __doc__.strip().splitlines()[0])
    info = mdist.init_distributed()
    mdist.seed_everything(cfg.run.seed, info.rank)
    torch.use_deterministic_algorithms(True, warn_only=True)
    comp = components.build(cfg)
    comp.model.to(info.device)
    comp.text_encoder.to(info.device)
    if comp.vae is not None:
        comp.vae.to(info.device)
    prepare, criterion = components.make_step_fns(comp, info.device)
    n_params = sum(p.numel() for p in comp.model.parameters())
    flops_per_sample = comp.model.flops_per_sample()
    pm = parallelize(comp.model, cfg.parallel, info, microbatches=cfg.train.grad_accum, criterion=criterion)
    if cfg.data.buckets:
        raise ConfigError("data.buckets: text2image trains at one resolution (model.image_size); buckets are for "
                          "pipelines with variable shapes")
    loader = StreamingLoader.from_config(cfg.data, ImageDecoder(cfg.model.image_size, use_latents=bool(cfg.vae.path)),
                                         dp_rank=pm.dp_rank, dp_size=pm.dp_size, seed=cfg.run.seed)
    # The sample grid shows held-out captions: colour/shape pairs never seen together in training.
    prompts = [c for c, _ in first_examples(cfg.data.eval_shards, cfg.sample.num)] if cfg.data.eval_shards else []
    if info.is_main:
        print(f"text2image: DiT {n_params / 1e6:.2f}M params, {comp.num_tokens} tokens/sample, "
              f"{loader.num_samples} training samples, world size {info.world_size} [{pm.dims.describe}], "
              f"device {info.device}", flush=True)

    def sample_fn(model_for_sampling, step: int) -> None:
        if not prompts:
            return
        seeds = [cfg.sample.seed + i for i in range(len(prompts))]
        images = components.generate(comp, model_for_sampling, prompts, seeds, steps=cfg.sample.steps,
                                     guidance=cfg.sample.cfg, device=info.device)
        if info.is_main:
            path = os.path.join(cfg.run.dir, "samples", f"step_{step:08d}.png")
            components.save_grid(images, path, scale=4)
            with open(os.path.join(cfg.run.dir, "samples", f"step_{step:08d}.txt"), "w") as f:
                f.write("\n".join(prompts) + "\n")

    trainer = Trainer(cfg, info, pm, prepare, criterion, loader,
                      signature=components.signature(cfg, comp),
                      frozen={"text_encoder": comp.text_encoder}, sample_fn=sample_fn,
                      flops_per_sample=flops_per_sample)
    summary = trainer.fit()
    if info.is_main:
        print(f"done: step {summary['step']}, skipped steps {summary['skipped_steps']}, "
              f"corrupt samples {summary['corrupt_samples']}; run dir {cfg.run.dir}", flush=True)
    mdist.teardown()
    return 0


if __name__ == "__main__":
    run_cli(main)
