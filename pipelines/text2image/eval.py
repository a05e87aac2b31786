"""Evaluate a text2image run on held-out prompts from the synthetic dataset.

For each held-out sample the caption is used as the prompt; the generated image is analysed
from its pixels alone (data.shape_analysis) and compared with the sample's attributes. Prints
colour, shape and joint accuracy and writes eval.json into the run directory.

  python -m pipelines.text2image.eval --run RUN_DIR [--shards SPEC] [--num N] [--steps S] [--cfg W]
"""
from common.cli import run_cli
from common.run import evaluate
from data.shape_analysis import score
from pipelines.text2image.spec import SPEC


def main(argv=None) -> int:
    return evaluate(SPEC, argv, __doc__, default_num=256, grid_max=64, needs="shape", data_hint="data.synth",
                    score=lambda images, attrs: score(images.numpy(), attrs),
                    report=lambda r: (f"colour accuracy {r['colour_acc']:.1%}, shape accuracy {r['shape_acc']:.1%}, "
                                      f"both {r['both_acc']:.1%}"))


if __name__ == "__main__":
    run_cli(main)
