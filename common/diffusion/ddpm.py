"""DDPM (discrete-time Gaussian diffusion) with eps- or v-prediction; the second objective.

The model is called as model_fn(x_t, t / T, cond): time normalised to [0, 1] so the same DiT
(which embeds t * 1000) serves both objectives. Schedules are kept in float64.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from .flow import mse_per_sample
from .noise import SALT_NOISE, SALT_TIME, per_sample_rand, per_sample_randn


def _bcast(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return a.view(-1, *([1] * (x.dim() - 1))).to(x.device, x.dtype)


# Stable Diffusion's betas: linear in sqrt(beta) between these (its "scaled_linear"), so that a
# pretrained SD UNet is fine-tuned on the noise levels it was trained on.
SD_BETA_START, SD_BETA_END = 0.00085, 0.012
SCHEDULES = ("linear", "cosine", "scaled_linear")


def make_betas(schedule: str, num_timesteps: int, beta_start: float = 1e-4, beta_end: float = 0.02):
    """float64 betas. linear: beta_start..beta_end; cosine: alpha_bar from the cosine (beta_* unused);
    scaled_linear: Stable Diffusion's schedule, always between SD_BETA_START and SD_BETA_END."""
    if schedule == "linear":  # Ho et al. 2020
        return torch.linspace(beta_start, beta_end, num_timesteps, dtype=torch.float64)
    if schedule == "scaled_linear":
        return torch.linspace(SD_BETA_START ** 0.5, SD_BETA_END ** 0.5, num_timesteps, dtype=torch.float64) ** 2
    if schedule == "cosine":  # Nichol & Dhariwal 2021, s = 0.008, betas clipped at 0.999
        s = 0.008
        f = lambda u: math.cos((u + s) / (1 + s) * math.pi / 2) ** 2  # noqa: E731
        b = [min(1 - f((i + 1) / num_timesteps) / f(i / num_timesteps), 0.999) for i in range(num_timesteps)]
        return torch.tensor(b, dtype=torch.float64)
    raise ValueError(f"unknown beta schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")


class DDPM:
    def __init__(self, num_timesteps: int = 1000, schedule: str = "linear", prediction: str = "eps",
                 beta_start: float = 1e-4, beta_end: float = 0.02):
        if prediction not in ("eps", "v"):
            raise ValueError(f"prediction must be 'eps' or 'v', got {prediction!r}")
        self.num_timesteps, self.prediction = num_timesteps, prediction
        self.betas = make_betas(schedule, num_timesteps, beta_start, beta_end)
        self.alphas_cumprod = torch.cumprod(1 - self.betas, 0)

    def coefs(self, t: torch.Tensor, x: torch.Tensor):
        """(sqrt(alpha_bar_t), sqrt(1 - alpha_bar_t)) broadcast to x."""
        ab = self.alphas_cumprod[t.long().cpu()]
        return _bcast(ab.sqrt(), x), _bcast((1 - ab).sqrt(), x)

    def sample_t(self, seeds, *, device=None) -> torch.Tensor:
        u = per_sample_rand(seeds, SALT_TIME, dtype=torch.float64)
        return (u * self.num_timesteps).long().clamp_max(self.num_timesteps - 1).to(device)

    def q_sample(self, x0, eps, t):
        a, s = self.coefs(t, x0)
        return a * x0 + s * eps

    def target(self, x0, eps, t):
        if self.prediction == "eps":
            return eps
        a, s = self.coefs(t, x0)
        return a * eps - s * x0  # v (Salimans & Ho 2022)

    def to_x0_eps(self, x_t, t, model_out):
        """Convert a model output (eps or v) at x_t to the implied (x0, eps)."""
        a, s = self.coefs(t, x_t)
        if self.prediction == "eps":
            eps = model_out
            x0 = (x_t - s * eps) / a
        else:
            x0 = a * x_t - s * model_out
            eps = s * x_t + a * model_out
        return x0, eps

    def model_time(self, t: torch.Tensor) -> torch.Tensor:
        return t.float() / self.num_timesteps

    def training_example(self, x0: torch.Tensor, seeds, num_tokens: int | None = None):
        """(x_t, model time in [0, 1], target) for a training step. num_tokens: unused (the
        schedule does not depend on resolution); accepted so both objectives are called alike."""
        t = self.sample_t(seeds, device=x0.device)
        eps = per_sample_randn(seeds, x0.shape[1:], SALT_NOISE, device=x0.device, dtype=x0.dtype)
        return self.q_sample(x0, eps, t), self.model_time(t), self.target(x0, eps, t)

    def example_at(self, x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor):
        """(x_t, model time, target) at noise fractions t (B,) in [0, 1]: timestep round(t (T - 1))."""
        step = (t.double() * (self.num_timesteps - 1)).round().long()
        return self.q_sample(x0, eps, step), self.model_time(step).to(x0.device), self.target(x0, eps, step)

    def loss(self, model_fn: Callable, x0: torch.Tensor, cond, seeds, num_tokens: int | None = None):
        """Returns (mean loss, per-sample MSE (B,)) on the chosen prediction target."""
        x_t, t, target = self.training_example(x0, seeds)
        per_sample = mse_per_sample(model_fn(x_t, t, cond), target)
        return per_sample.mean(), per_sample

    def sample(self, model_fn: Callable, noise: torch.Tensor, *, cond=None, uncond=None, guidance: float = 1.0,
               num_steps: int = 50, num_tokens: int | None = None, device=None) -> torch.Tensor:
        """Deterministic DDIM (eta = 0) from noise; num_tokens unused (as in training_example)."""
        from .samplers import ddim_sample
        return ddim_sample(model_fn, self, noise.shape, cond, num_steps=num_steps, uncond=uncond, guidance=guidance,
                           noise=noise, device=device)
