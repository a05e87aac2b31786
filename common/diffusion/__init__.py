"""Diffusion objectives and samplers. Time convention: t = 0 data, t = 1 noise."""
from .ddpm import DDPM, make_betas
from .flow import RectifiedFlow, shift_time
from .noise import (SALT_DROP, SALT_NOISE, SALT_TIME, drop_mask, mix_seed, per_sample_rand,
                    per_sample_randn, sample_generators)
from .samplers import ddim_sample, euler_sample, flow_timesteps, guided

__all__ = ["DDPM", "make_betas", "RectifiedFlow", "shift_time", "SALT_DROP", "SALT_NOISE", "SALT_TIME",
           "drop_mask", "mix_seed", "per_sample_rand", "per_sample_randn", "sample_generators",
           "ddim_sample", "euler_sample", "flow_timesteps", "guided"]
