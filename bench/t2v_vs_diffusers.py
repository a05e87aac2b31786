"""The text2video training step against diffusers' Wan transformer at identical dimensions.

Both sides run in this process, on the same CPU threads, in alternating rounds
(bench/peer_rounds.py). Each step: a batch of clips in [-1, 1], rectified-flow noising, fp32
forward/backward, MSE on the velocity, gradient clipping at 1.0, AdamW.

  ours   the project's real step: pipelines/text2video/components.make_step_fns (per-sample seeded
         noise and logit-normal timesteps, the frozen text tower as training runs it) -> VideoDiT
         (full attention over T*H*W patches) -> loss -> backward -> clip -> AdamW
         (common/optim.build_optimizer) -> EMA update.
  peer   diffusers.WanTransformer3DModel, the closest diffusers video transformer to ours (3-D
         patch embedding, 3-D RoPE, self-attention with QK RMS-norm, cross-attention to the text
         tokens behind a LayerNorm, adaLN modulation from the timestep): the same width, depth,
         heads, head dim, MLP width, (temporal, spatial) patch, clip shape, channels, caption
         width and text length, in a plain rectified-flow loop: torch.randn noise, text features
         precomputed once (the peer pays nothing for text; as Wan is trained, padding positions
         are zero vectors and are attended to, where ours masks them), no EMA.

The ratio printed is ours / peer in samples (clips) per second, the median over rounds, and the
ratio of each side's best round, and the middle half of the rounds' own ratios
(bench/peer_rounds.py); > 1 means ours is faster. Config "demo" is the shipped tiny.yaml
(8 frames of 32 px, patches 2x4x4: 256 tokens; hidden 128, depth 4, 4 heads; batch 16 as the
demo trains). Where other load steals time (a shared VM), `--threads 1 --clock cpu` compares the
work done.

  python bench/t2v_vs_diffusers.py [--rounds 5] [--steps 4] [--threads 2] [--clock wall|cpu] [overrides...]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.peer_rounds import OursStep, add_arguments, measure, optimizer_step, run_configs  # noqa: E402
from common.config import build_config  # noqa: E402
from pipelines.text2video import components  # noqa: E402
from pipelines.text2video.config import T2VConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"demo": []}
COLOURS = ("red", "green", "blue", "yellow", "purple", "white")
SHAPES = ("circle", "square", "triangle", "cross")
MOTIONS = ("moving left to right", "moving up", "growing", "moving to the left", "shrinking")


def captions(n: int, step: int) -> list[str]:
    # Demo-like captions, varying between steps as a shuffled dataset's do.
    return [f"a {COLOURS[(i + step) % 6]} {SHAPES[(i * 7 + step) % 4]} {MOTIONS[(i * 3 + step) % 5]}"
            for i in range(n)]


class Ours(OursStep):
    def __init__(self, overrides: list[str], batch: int):
        cfg = build_config(T2VConfig, os.path.join(ROOT, "pipelines/text2video/configs/tiny.yaml"), overrides)
        super().__init__(cfg, components.build(cfg), components.make_step_fns, batch)
        self.shape = self.comp.clip_shape  # (C, T, H, W)

    def make_batch(self, i: int) -> dict:
        b = self.batch
        return {"video": torch.rand(b, *self.shape) * 2 - 1, "caption": captions(b, i),
                "__position__": torch.arange(i * b, (i + 1) * b)}


def peer_model(m) -> torch.nn.Module:
    """WanTransformer3DModel at the dimensions of our VideoDiT config `m`."""
    from diffusers import WanTransformer3DModel
    return WanTransformer3DModel(
        patch_size=(m.temporal_patch, m.patch_size, m.patch_size), num_attention_heads=m.heads,
        attention_head_dim=m.hidden // m.heads, in_channels=m.in_channels, out_channels=m.in_channels,
        text_dim=m.text_dim, ffn_dim=int(m.hidden * m.mlp_ratio), num_layers=m.depth, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=max(m.frames, m.height, m.width))


class Peer:
    def __init__(self, ours: Ours):
        self.model = peer_model(ours.model.cfg)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=ours.cfg.optim.lr,
                                     weight_decay=ours.cfg.optim.weight_decay)
        self.batch, self.shape = ours.batch, ours.shape
        with torch.no_grad():  # precomputed once: the peer's text costs nothing per step
            context, mask = ours.comp.text_encoder(captions(ours.batch, 0))
        self.context = context * mask[..., None]  # padding as zero vectors, as Wan's text is prepared
        self.params = sum(p.numel() for p in self.model.parameters())

    def step(self) -> float:
        x0 = torch.rand(self.batch, *self.shape) * 2 - 1
        eps = torch.randn_like(x0)
        t = torch.sigmoid(torch.randn(self.batch))
        tb = t.view(-1, 1, 1, 1, 1)
        x_t = (1 - tb) * x0 + tb * eps
        pred = self.model(x_t, timestep=t * 1000, encoder_hidden_states=self.context, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred, eps - x0)
        return optimizer_step(self.model, self.opt, loss)


def compare(name: str, args, steps: int) -> dict:
    torch.manual_seed(0)
    ours = Ours(CONFIGS[name] + args.overrides, args.batch)
    m = ours.model.cfg
    return measure(ours, Peer, {"config": name, "hidden": m.hidden, "depth": m.depth, "heads": m.heads,
                                "tokens": m.num_tokens, "clip": list(ours.shape)}, args, steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p, configs="demo", batch=16, json_name="t2v_vs_diffusers.json", root=ROOT)
    run_configs(p, CONFIGS, compare, lambda name: 4,
                lambda r: f"{r['config']:5} hidden {r['hidden']} depth {r['depth']} tokens {r['tokens']} clip "
                          f"{r['clip']} batch {r['batch']}: ours {r['ours_samples_per_s']:.1f} clips/s "
                          f"({r['params_ours'] / 1e6:.2f}M params), diffusers Wan {r['peer_samples_per_s']:.1f} "
                          f"({r['params_peer'] / 1e6:.2f}M): ")


if __name__ == "__main__":
    main()
