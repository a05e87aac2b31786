"""Generate images from a text2image run's latest checkpoint (EMA weights).

  python -m pipelines.text2image.sample --run RUN_DIR (--prompt TEXT | --prompts FILE) --out DIR
         [--num N] [--steps S] [--cfg W] [--seed K]

Writes one PNG per image, index.jsonl (file -> prompt, seed) and grid.png.
"""
from common.cli import run_cli
from common.run import sample
from pipelines.text2image.spec import SPEC


def main(argv=None) -> int:
    return sample(SPEC, argv, __doc__)


if __name__ == "__main__":
    run_cli(main)
