"""Generate 3-D shapes from a text23d run's latest checkpoint (EMA weights).

  python -m pipelines.text23d.sample --run RUN_DIR (--prompt TEXT | --prompts FILE) --out DIR
         [--num N] [--steps S] [--cfg W] [--seed K]

Writes one PLY point cloud per shape (xyz + rgb; stage latent also a coloured mesh, *_mesh.ply,
from marching cubes on the decoded occupancy), index.jsonl (file -> prompt, seed) and a turntable
preview: grid.png (one row per shape, one column per view) and grid.gif.
"""
from common.cli import run_cli
from common.run import sample
from pipelines.text23d.spec import SPEC


def main(argv=None) -> int:
    return sample(SPEC, argv, __doc__)


if __name__ == "__main__":
    run_cli(main)
