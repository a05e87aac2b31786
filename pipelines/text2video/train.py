"""Train a text-to-video DiT.

  python -m pipelines.text2video.train --config pipelines/text2video/configs/tiny.yaml [key=value ...]
  torchrun --nproc_per_node 4 -m pipelines.text2video.train --config ... parallel.dp_shard=2 parallel.cp=2

Parallel layouts (parallel.*): dp_shard/dp_replicate (FSDP, HSDP), tp (+ sequence_parallel),
cp with cp_mode ulysses|ring|hybrid (full attention only), activation_checkpoint, compile.
Their product must equal the number of processes. Pipeline parallelism is not supported yet.
Run directory: config.yaml, metrics.jsonl, checkpoints/, tb/, samples/step_XXXXXXXX.{mp4,gif,txt}.
"""
from __future__ import annotations

import os

import torch

from common import dist as mdist
from common.cli import run_cli
from common.config import parse_cli
from common.data import StreamingLoader
from common.trainer import Trainer
from pipelines.text2video import components
from pipelines.text2video.config import T2VConfig
from pipelines.text2video.data import ClipDecoder, first_examples
from pipelines.text2video.parallelize import parallelize


def main(argv=None) -> int:
    cfg: T2VConfig = parse_cli(T2VConfig, argv, "python -m pipelines.text2video.train", __doc__.strip().splitlines()[0])
    info = mdist.init_distributed()
    mdist.seed_everything(cfg.run.seed, info.rank)
    torch.use_deterministic_algorithms(True, warn_only=True)
    comp = components.build(cfg)
    comp.model.to(info.device)
    comp.text_encoder.to(info.device)
    prepare, criterion = components.make_step_fns(comp, info.device)
    n_params = sum(p.numel() for p in comp.model.parameters())
    flops_per_sample = comp.model.flops_per_sample()
    pm = parallelize(comp.model, cfg.parallel, info, microbatches=cfg.train.grad_accum, criterion=criterion)
    mc = comp.model.cfg
    decoder = ClipDecoder(comp.pixel_clip_shape[0], comp.pixel_clip_shape[1:], cfg.video.source, cfg.video.images)
    # Buckets are (frames, h, w); their token count decides the per-bucket batch size.
    loader = StreamingLoader.from_config(cfg.data, decoder, dp_rank=pm.dp_rank, dp_size=pm.dp_size, seed=cfg.run.seed,
                                         tokens=comp.clip_tokens)
    prompts = [c for c, _ in first_examples(cfg.data.eval_shards, cfg.sample.num)] if cfg.data.eval_shards and cfg.sample.num else []
    if info.is_main:
        print(f"text2video: VideoDiT {n_params / 1e6:.2f}M params, {mc.num_tokens} tokens/clip "
              f"({mc.frames}x{mc.height}x{mc.width}, {mc.attention} attention), {loader.num_samples} training samples, "
              f"world size {info.world_size} [{pm.dims.describe}], device {info.device}", flush=True)

    def sample_fn(model_for_sampling, step: int) -> None:
        if not prompts:
            return
        seeds = [cfg.sample.seed + i for i in range(len(prompts))]
        clips = components.generate(comp, model_for_sampling, prompts, seeds, steps=cfg.sample.steps,
                                    guidance=cfg.sample.cfg, device=info.device)
        if info.is_main:
            stem = os.path.join(cfg.run.dir, "samples", f"step_{step:08d}")
            components.save_video_grid(clips, stem, cfg.sample.fps, cfg.sample.scale)
            with open(stem + ".txt", "w") as f:
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
