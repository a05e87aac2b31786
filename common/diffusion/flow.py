"""Rectified flow (flow matching with straight paths), SD3-style.

Direction: t = 0 is data, t = 1 is noise. x_t = (1 - t) x0 + t eps; the model predicts the
velocity v = dx_t/dt = eps - x0; samplers integrate from t = 1 down to t = 0.

Timestep shift t' = s t / (1 + (s - 1) t) moves mass towards noise for s > 1: larger images
keep more signal at a given t, so they need more time near t = 1 (SD3 sec. 5.3.2). s is
`shift` when set (fixed), else sqrt(num_tokens / base_tokens) * base_shift when num_tokens is
given (resolution dependent), else base_shift.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .noise import SALT_NOISE, SALT_TIME, per_sample_rand, per_sample_randn


def shift_time(t: torch.Tensor, s: float) -> torch.Tensor:
    """Monotone bijection of [0, 1] with fixed endpoints; s = 1 is the identity."""
    return s * t / (1 + (s - 1) * t)


def _bcast(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.view(-1, *([1] * (x.dim() - 1))).to(x.dtype)


@dataclass
class RectifiedFlow:
    timestep_sampling: str = "logit_normal"  # or "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float | None = None      # fixed shift; None -> resolution dependent
    base_shift: float = 1.0
    base_tokens: int = 256          # token count at which the resolution shift equals base_shift

    def shift_for(self, num_tokens: int | None = None) -> float:
        if self.shift is not None:
            return float(self.shift)
        if num_tokens is None:
            return float(self.base_shift)
        return math.sqrt(num_tokens / self.base_tokens) * self.base_shift

    def sample_t(self, seeds, num_tokens: int | None = None, *, device=None) -> torch.Tensor:
        """(B,) fp32 training times in (0, 1), per-sample deterministic."""
        u = per_sample_rand(seeds, SALT_TIME, device=device, dtype=torch.float64)
        if self.timestep_sampling == "logit_normal":
            # Inverse normal CDF of u gives a per-sample normal without a second stream.
            z = math.sqrt(2.0) * torch.erfinv(2 * u.clamp(1e-7, 1 - 1e-7) - 1)
            t = torch.sigmoid(self.logit_mean + self.logit_std * z)
        elif self.timestep_sampling == "uniform":
            t = u
        else:
            raise ValueError(f"unknown timestep_sampling {self.timestep_sampling!r}")
        return shift_time(t, self.shift_for(num_tokens)).float()

    @staticmethod
    def interpolate(x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        tb = _bcast(t, x0)
        return (1 - tb) * x0 + tb * eps

    @staticmethod
    def target(x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        return eps - x0

    def training_example(self, x0: torch.Tensor, seeds, num_tokens: int | None = None):
        """(x_t, t, target) for a training step: what the model sees and what it should predict."""
        t = self.sample_t(seeds, num_tokens, device=x0.device)
        eps = per_sample_randn(seeds, x0.shape[1:], SALT_NOISE, device=x0.device, dtype=x0.dtype)
        return self.example_at(x0, eps, t)

    def example_at(self, x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor):
        """(x_t, t, target) at given times t (B,) in [0, 1] (the noise fraction, no shift applied)."""
        return self.interpolate(x0, eps, t), t, self.target(x0, eps)

    def loss(self, model_fn: Callable, x0: torch.Tensor, cond, seeds, num_tokens: int | None = None):
        """model_fn(x_t, t, cond) -> v. Returns (mean loss, per-sample MSE (B,)).
        The per-sample losses let a sharded run reproduce the global mean exactly."""
        x_t, t, target = self.training_example(x0, seeds, num_tokens)
        per_sample = mse_per_sample(model_fn(x_t, t, cond), target)
        return per_sample.mean(), per_sample

    def sample(self, model_fn: Callable, noise: torch.Tensor, *, cond=None, uncond=None, guidance: float = 1.0,
               num_steps: int = 50, num_tokens: int | None = None, device=None) -> torch.Tensor:
        """Euler from t = 1 (noise) to t = 0 with the shift of `num_tokens` (see shift_for)."""
        from .samplers import euler_sample
        return euler_sample(model_fn, noise.shape, cond, num_steps=num_steps, shift=self.shift_for(num_tokens),
                            uncond=uncond, guidance=guidance, noise=noise, device=device)


def mse_per_sample(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(B,) mean squared error per sample, accumulated in fp32."""
    return (pred.float() - target.float()).pow(2).flatten(1).mean(1)
