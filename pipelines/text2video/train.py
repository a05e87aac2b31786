"""Train a text-to-video DiT.

  python -m pipelines.text2video.train --config pipelines/text2video/configs/tiny.yaml [key=value ...]
  torchrun --nproc_per_node 4 -m pipelines.text2video.train --config ... parallel.dp_shard=2 parallel.cp=2

Parallel layouts (parallel.*): dp_shard/dp_replicate (FSDP, HSDP), tp (+ sequence_parallel),
cp with cp_mode ulysses|ring|hybrid (full attention only), activation_checkpoint, compile.
Their product must equal the number of processes. Pipeline parallelism is not supported yet.
Run directory: config.yaml, metrics.jsonl, checkpoints/, tb/, samples/step_XXXXXXXX.{mp4,gif,txt}.
"""
from common.cli import run_cli
from common.run import train
from pipelines.text2video.spec import SPEC

if __name__ == "__main__":
    run_cli(lambda argv: train(SPEC, argv))
