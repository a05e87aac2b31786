"""Exponential moving average of the trainable weights, kept in fp32.

Works on plain tensors and on FSDP2's sharded DTensors alike: each rank averages only the
shard it owns, so EMA memory shards with the model.
"""
from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class EMA:
    def __init__(self, model: torch.nn.Module, decay: float, warmup: bool = True):
        self.decay = decay
        self.warmup = warmup
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.shadow = {n: p.detach().clone().float() for n, p in self.params.items()}

    def effective_decay(self, step: int) -> float:
        if self.warmup:
            return min(self.decay, (1.0 + step) / (10.0 + step))
        return self.decay

    @torch.no_grad()
    def update(self, step: int) -> None:
        d = self.effective_decay(step)
        names = list(self.params)
        # Elementwise, so each rank updates its local shard; local tensors also let one foreach
        # call cover DTensors on different meshes and plain tensors together.
        shadow = [_local(self.shadow[n]) for n in names]
        live = [_local(self.params[n].detach()).float() for n in names]
        torch._foreach_lerp_(shadow, live, 1.0 - d)

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_in(self):
        """Temporarily put the EMA weights into the live model (for sampling), then restore."""
        backup = {n: p.detach().clone() for n, p in self.params.items()}
        for n, p in self.params.items():
            p.copy_(self.shadow[n].to(p.dtype))
        try:
            yield
        finally:
            for n, p in self.params.items():
                p.copy_(backup[n])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.shadow
