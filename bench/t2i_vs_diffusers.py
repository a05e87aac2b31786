"""The text2image training step against diffusers' PixArt transformer at identical dimensions.

Both sides run in this process, on the same CPU threads, in alternating rounds (ours first in
even rounds, the peer first in odd ones), so that load from anything else on the machine falls
on both alike. Each step: a batch of 32 images in [-1, 1], rectified-flow noising, fp32
forward/backward, MSE on the velocity, gradient clipping at 1.0, AdamW.

  ours   the project's real step: pipelines/text2image/components.make_step_fns (per-sample seeded
         noise and logit-normal timesteps, the frozen text tower as training runs it) -> DiT ->
         loss -> backward -> clip -> AdamW (common/optim.build_optimizer) -> EMA update.
  peer   diffusers.PixArtTransformer2DModel (adaLN-single, the same width, depth, heads, patch,
         image size, channels, caption width and text length) in a plain rectified-flow loop:
         torch.randn noise, text features precomputed once (the peer pays nothing for text),
         no EMA.

The ratio printed is ours / peer in samples per second (median over rounds); > 1 means ours is
faster. Beside it, the ratio of each side's best round: on a shared machine (a VM whose
neighbours come and go) other load only ever slows a round, so the best rounds are the steadier
estimate when the medians drift between runs; last, the middle half of the rounds' own ratios
(bench/peer_rounds.py). Configs: "demo" is the shipped tiny.yaml (hidden
128, depth 4, 64 tokens); "S" is DiT-S (hidden 384, depth 12, 6 heads, patch 2 on 32 px: 256
tokens, caption width 512).

Where other load steals time (a shared VM), `--threads 1 --clock cpu` compares the work done:
process CPU time excludes the stolen time that makes wall-clock medians drift.

  python bench/t2i_vs_diffusers.py [--configs demo,S] [--rounds 5] [--steps 4] [--threads 2] [--clock wall|cpu]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.peer_rounds import OursStep, add_arguments, measure, optimizer_step, run_configs  # noqa: E402
from common.config import build_config  # noqa: E402
from pipelines.text2image import components  # noqa: E402
from pipelines.text2image.config import T2IConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {
    "demo": [],
    "S": ["model.preset=S", "model.patch_size=2", "text.width=512", "text.layers=4", "text.heads=8"],
}
COLOURS = ("red", "green", "blue", "yellow", "purple", "white")
SHAPES = ("circle", "square", "triangle", "cross")


def captions(n: int, step: int) -> list[str]:
    # Demo-like captions, varying between steps as a shuffled dataset's do.
    return [f"a {COLOURS[(i + step) % 6]} {SHAPES[(i * 7 + step) % 4]} in the {('top', 'bottom')[i % 2]} left"
            for i in range(n)]


class Ours(OursStep):
    def __init__(self, overrides: list[str], batch: int):
        cfg = build_config(T2IConfig, os.path.join(ROOT, "pipelines/text2image/configs/tiny.yaml"), overrides)
        super().__init__(cfg, components.build(cfg), components.make_step_fns, batch)
        self.size, self.channels = self.comp.latent_size, self.comp.latent_channels

    def make_batch(self, i: int) -> dict:
        b = self.batch
        return {"image": torch.rand(b, self.channels, self.size, self.size) * 2 - 1, "caption": captions(b, i),
                "__position__": torch.arange(i * b, (i + 1) * b)}


class Peer:
    def __init__(self, ours: Ours):
        from diffusers import PixArtTransformer2DModel

        m = ours.model.cfg
        self.model = PixArtTransformer2DModel(
            num_attention_heads=m.heads, attention_head_dim=m.hidden // m.heads, in_channels=m.in_channels,
            out_channels=m.in_channels, num_layers=m.depth, cross_attention_dim=m.hidden, sample_size=m.img_size,
            patch_size=m.patch_size, caption_channels=m.text_dim, norm_type="ada_norm_single",
            use_additional_conditions=False, activation_fn="gelu-approximate", attention_bias=True)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=ours.cfg.optim.lr,
                                     weight_decay=ours.cfg.optim.weight_decay)
        self.batch, self.size, self.channels = ours.batch, m.img_size, m.in_channels
        with torch.no_grad():  # precomputed once: the peer's text costs nothing per step
            self.context, mask = ours.comp.text_encoder(captions(ours.batch, 0))
        self.mask = mask.float()
        self.params = sum(p.numel() for p in self.model.parameters())

    def step(self) -> float:
        b = self.batch
        x0 = torch.rand(b, self.channels, self.size, self.size) * 2 - 1
        eps = torch.randn_like(x0)
        t = torch.sigmoid(torch.randn(b))
        tb = t.view(-1, 1, 1, 1)
        x_t = (1 - tb) * x0 + tb * eps
        pred = self.model(x_t, encoder_hidden_states=self.context, timestep=t * 1000,
                          encoder_attention_mask=self.mask, added_cond_kwargs={"resolution": None, "aspect_ratio": None},
                          return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred, eps - x0)
        return optimizer_step(self.model, self.opt, loss)


def compare(name: str, args, steps: int) -> dict:
    torch.manual_seed(0)
    ours = Ours(CONFIGS[name] + args.overrides, args.batch)
    m = ours.model.cfg
    return measure(ours, Peer, {"config": name, "hidden": m.hidden, "depth": m.depth, "heads": m.heads,
                                "tokens": ours.comp.num_tokens}, args, steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p, configs="demo,S", batch=32, json_name="t2i_vs_diffusers.json", root=ROOT)
    run_configs(p, CONFIGS, compare, lambda name: 8 if name == "demo" else 2,
                lambda r: f"{r['config']:5} hidden {r['hidden']} depth {r['depth']} tokens {r['tokens']} batch "
                          f"{r['batch']}: ours {r['ours_samples_per_s']:.1f} samples/s ({r['params_ours'] / 1e6:.2f}M "
                          f"params), diffusers PixArt {r['peer_samples_per_s']:.1f} ({r['params_peer'] / 1e6:.2f}M): ")


if __name__ == "__main__":
    main()
