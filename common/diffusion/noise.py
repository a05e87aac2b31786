"""Per-sample randomness that does not depend on how the batch is split.

Each sample owns a torch.Generator seeded by mix(seed, salt), where `seed` is what the trainer
derives from the sample's global position and the run seed. A rank holding rows [a, b) of the
global batch passes seeds[a:b] and draws exactly the rows the single-process run draws. Noise
is always drawn on CPU and then moved, so CPU and CUDA runs see identical values. `salt`
separates streams (timesteps, noise, CFG dropout) drawn for the same sample.
"""
from __future__ import annotations

from typing import Sequence

import torch

SALT_TIME, SALT_NOISE, SALT_DROP = 1, 2, 3
_SALT_RUN = 0x52554E  # folds a large run seed into the per-sample seed space
_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1
_POSITION_BITS = 40  # a run seed below 2^23 owns the per-sample seeds [seed << 40, (seed + 1) << 40)


def mix_seed(seed: int, salt: int = 0) -> int:
    """splitmix64 of (seed, salt): nearby seeds/salts give unrelated streams."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(salt) * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)  # manual_seed wants a non-negative int64


def sample_seeds(run_seed: int, positions: torch.Tensor) -> torch.Tensor:
    """Per-sample seeds from global sample positions (the loader's `__position__`): identical
    under any parallel layout and across resumes; non-negative int64 for any run seed in
    [0, 2^63). Run seeds below 2^23 keep the layout seed * 2^40 + position (the noise of existing
    runs); above, seed * 2^40 would overflow int64 (wrapping, so seeds 2^24 apart collided), so
    the run seed is hashed to a 63-bit offset instead, the sum taken mod 2^63."""
    run_seed = int(run_seed)
    if not 0 <= run_seed <= _MASK63:
        raise ValueError(f"run seed {run_seed} is outside [0, 2^63)")
    if run_seed < 1 << (63 - _POSITION_BITS):
        offset = run_seed << _POSITION_BITS
    else:
        offset = mix_seed(run_seed, _SALT_RUN)
    # int64 addition wraps two's-complement; the mask maps the sum back to [0, 2^63).
    return (positions.long() + offset) & _MASK63


def _seed_list(seeds) -> list[int]:
    if isinstance(seeds, torch.Tensor):
        return [int(s) for s in seeds.reshape(-1).tolist()]
    return [int(s) for s in seeds]


def sample_generators(seeds, salt: int = 0) -> list[torch.Generator]:
    """One CPU generator per sample, seeded by mix_seed(seed, salt)."""
    return [torch.Generator().manual_seed(mix_seed(s, salt)) for s in _seed_list(seeds)]


def per_sample_randn(seeds, shape: Sequence[int], salt: int = SALT_NOISE, *, device=None,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(B, *shape) standard normal noise; row i depends only on (seeds[i], salt)."""
    gens = sample_generators(seeds, salt)
    out = torch.stack([torch.randn(tuple(shape), generator=g) for g in gens]) if gens else \
        torch.empty(0, *shape)
    return out.to(device=device, dtype=dtype)


def per_sample_rand(seeds, salt: int = SALT_TIME, shape: Sequence[int] = (), *, device=None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(B, *shape) uniform [0, 1); row i depends only on (seeds[i], salt)."""
    gens = sample_generators(seeds, salt)
    out = torch.stack([torch.rand(tuple(shape), generator=g) for g in gens]) if gens else \
        torch.empty(0, *shape)
    return out.to(device=device, dtype=dtype)


def drop_mask(seeds, p: float, salt: int = SALT_DROP, *, device=None) -> torch.Tensor:
    """(B,) bool: True where the condition is dropped (classifier-free guidance training)."""
    return per_sample_rand(seeds, salt, device=device, dtype=torch.float64) < p


def drop_captions(captions, seeds, p: float) -> list[str]:
    """Captions with those of drop_mask replaced by "" (the unconditional caption for CFG)."""
    captions = list(captions)
    if p <= 0:
        return captions
    return ["" if d else c for c, d in zip(captions, drop_mask(seeds, p).tolist())]

