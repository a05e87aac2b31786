"""Samplers: Euler for rectified flow (t: 1 -> 0) and DDIM for DDPM, both with classifier-free
guidance. `model_fn(x, t, cond)` as in training; `cond`/`uncond` may be a tensor, a tuple/list
of tensors (e.g. (context, mask)) or a dict of tensors, concatenated along the batch so the
conditional and unconditional predictions come from one forward pass.
"""
from __future__ import annotations

from typing import Callable

import torch

from .ddpm import DDPM
from .flow import shift_time


def _cat(a, b):
    if a is None:
        return None
    if isinstance(a, torch.Tensor):
        return torch.cat([a, b], 0)
    if isinstance(a, dict):
        return {k: _cat(a[k], b[k]) for k in a}
    if isinstance(a, (tuple, list)):
        return type(a)(_cat(x, y) for x, y in zip(a, b))
    raise TypeError(f"cannot batch condition of type {type(a).__name__}")


def guided(model_fn: Callable, x, t, cond, uncond=None, guidance: float = 1.0):
    """uncond + w (cond - uncond); one batched forward. Without uncond: the plain cond call."""
    if uncond is None:
        return model_fn(x, t, cond)
    out = model_fn(torch.cat([x, x], 0), torch.cat([t, t], 0), _cat(cond, uncond))
    c, u = out.chunk(2, 0)
    return u + guidance * (c - u)


def _initial_noise(shape, noise, generator, device, dtype):
    if noise is not None:
        return noise.to(device=device, dtype=dtype)
    # Drawn on CPU so the same generator gives the same image on every device.
    return torch.randn(tuple(shape), generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)


def flow_timesteps(num_steps: int, shift: float = 1.0) -> torch.Tensor:
    """(num_steps + 1,) times from 1 to 0, uniform in the unshifted time then shifted."""
    return shift_time(torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64), shift)


@torch.no_grad()
def euler_sample(model_fn: Callable, shape, cond=None, *, num_steps: int = 50, shift: float = 1.0,
                 uncond=None, guidance: float = 1.0, generator: torch.Generator | None = None,
                 noise: torch.Tensor | None = None, device=None, dtype=torch.float32) -> torch.Tensor:
    """Integrate dx/dt = v from x_1 = noise to t = 0: x_{t'} = x_t + (t' - t) v."""
    x = _initial_noise(shape, noise, generator, device, dtype)
    ts = flow_timesteps(num_steps, shift)
    for i in range(num_steps):
        t = torch.full((x.shape[0],), float(ts[i]), device=x.device, dtype=torch.float32)
        v = guided(model_fn, x, t, cond, uncond, guidance)
        x = x + float(ts[i + 1] - ts[i]) * v.to(x.dtype)
    return x


def ddim_timesteps(num_timesteps: int, num_steps: int) -> list[int]:
    """The DDPM timesteps DDIM visits, from T - 1 down to 0 (also what exported pipelines set)."""
    return torch.linspace(num_timesteps - 1, 0, num_steps).round().long().tolist()


@torch.no_grad()
def ddim_sample(model_fn: Callable, ddpm: DDPM, shape, cond=None, *, num_steps: int = 50, eta: float = 0.0,
                uncond=None, guidance: float = 1.0, generator: torch.Generator | None = None,
                noise: torch.Tensor | None = None, device=None, dtype=torch.float32) -> torch.Tensor:
    """DDIM (Song et al. 2021); eta = 0 deterministic, eta = 1 ancestral-like. Guidance is
    applied to the raw model output (eps or v), which is linear in both."""
    x = _initial_noise(shape, noise, generator, device, dtype)
    steps = ddim_timesteps(ddpm.num_timesteps, num_steps)
    ab = ddpm.alphas_cumprod
    for i, t_int in enumerate(steps):
        t = torch.full((x.shape[0],), t_int, dtype=torch.long, device=x.device)
        out = guided(model_fn, x, ddpm.model_time(t), cond, uncond, guidance)
        x0, eps = ddpm.to_x0_eps(x, t, out.to(x.dtype))
        a_t = ab[t_int]
        a_prev = ab[steps[i + 1]] if i + 1 < len(steps) else torch.tensor(1.0, dtype=torch.float64)
        sigma = eta * ((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)).clamp_min(0).sqrt()
        x = a_prev.sqrt().item() * x0 + (1 - a_prev - sigma ** 2).clamp_min(0).sqrt().item() * eps
        if eta > 0 and i + 1 < len(steps):
            z = torch.randn(x.shape, generator=generator, dtype=torch.float32).to(x.device, x.dtype)
            x = x + sigma.item() * z
    return x
