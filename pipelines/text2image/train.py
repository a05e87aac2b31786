"""Train a text-to-image DiT.

  python -m pipelines.text2image.train --config pipelines/text2image/configs/tiny.yaml [key=value ...]
  torchrun --nproc_per_node 4 -m pipelines.text2image.train --config ... parallel.tp=2   (FSDP 2 x TP 2)

Parallel layouts (parallel.*): dp_shard/dp_replicate (FSDP, HSDP), tp (+ sequence_parallel),
cp with cp_mode ulysses|ring|hybrid, pp with pp_schedule 1f1b|interleaved|zero_bubble|gpipe,
activation_checkpoint, compile. Their product must equal the number of processes.
"""
from common.cli import run_cli
from common.run import train
from pipelines.text2image.spec import SPEC

if __name__ == "__main__":
    run_cli(lambda argv: train(SPEC, argv))
