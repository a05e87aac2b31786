"""Train a text-to-3D model, one stage per run.

  python -m pipelines.text23d.train --config pipelines/text23d/configs/tiny_points.yaml   (stage A: point-cloud flow)
  python -m pipelines.text23d.train --config pipelines/text23d/configs/tiny_vae.yaml      (stage B: shape VAE)
  python -m pipelines.text23d.train --config pipelines/text23d/configs/tiny_latent.yaml vae.run=RUN_OF_THE_VAE
  torchrun --nproc_per_node 2 -m pipelines.text23d.train --config ... parallel.cp=2   (points sharded over 2 ranks)

Parallel layouts (parallel.*): the flow stages take every DiT layout (dp_shard/dp_replicate, tp,
cp over the point or latent tokens with cp_mode ulysses|ring|hybrid, pp); the vae stage is data
parallel (ddp or fsdp). Their product must equal the number of processes.
"""
from common.cli import run_cli
from common.run import train
from pipelines.text23d.spec import SPEC

if __name__ == "__main__":
    run_cli(lambda argv: train(SPEC, argv))
