"""Generate clips from a text2video run's latest checkpoint (EMA weights).

  python -m pipelines.text2video.sample --run RUN_DIR (--prompt TEXT | --prompts FILE) --out DIR
         [--num N] [--steps S] [--cfg W] [--seed K] [--frames T] [--fps F] [--scale K]

Writes one MP4 and one GIF per clip, index.jsonl (file -> prompt, seed) and grid.mp4 / grid.gif.
A latent-space run (vae.path in its config.yaml) reloads the VAE from that folder and decodes the
sampled latents to pixels; the checkpoint's signature must match that VAE's latent space.
"""
from common.cli import run_cli
from common.run import sample
from pipelines.text2video.spec import SPEC


def main(argv=None) -> int:
    return sample(SPEC, argv, __doc__)


if __name__ == "__main__":
    run_cli(main)
