"""torch.distributed set-up and the device / dtype policy.

The same entrypoint runs under plain `python` (world size 1, no process group) and under
`torchrun` (gloo on CPU, nccl on CUDA). The dtypes come from one PrecisionPolicy
(common/precision/policy.py): by default fp32 on CPU, whose cores have no bf16 units (bf16 ~75x
slower), and bf16 compute with fp32 master weights and fp32 reduction on CUDA, in every layout.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from common.precision.policy import PrecisionPolicy, default_policy, resolve_policy


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    precision: PrecisionPolicy = PrecisionPolicy()

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.precision.compute_dtype

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str = "auto", precision=None) -> DistInfo:
    """Initialise the process group when launched by torchrun; idempotent. precision: a
    PrecisionConfig (None: the device's default policy)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    policy = default_policy(dev) if precision is None else resolve_policy(precision, dev)
    return DistInfo(rank, world_size, local_rank, dev, policy)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def seed_everything(seed: int, rank: int = 0) -> None:
    """Per-rank seeds for anything that draws from global RNGs. Training noise does not: it is
    seeded per sample from global positions so parallel layouts draw identical noise."""
    s = seed + 1000003 * rank
    random.seed(s)
    np.random.seed(s % (2**32))
    torch.manual_seed(s)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
