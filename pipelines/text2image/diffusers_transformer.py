"""What the diffusers-backed transformers (pixart.py, sd3.py) share behind the DiT's interface: the
diffusers model held as `transformer` (its parameters keep diffusers' names under the
`transformer.` prefix), its blocks as the units of activation checkpointing and FSDP sharding, a
zero output projection, the FLOP count and the parallel dimensions it has no plan for."""
from __future__ import annotations

import inspect

from torch import nn

from pipelines.text2image.unet import _plain, denoiser_flops


def init_params(cls) -> dict:
    """{name: inspect.Parameter} of a diffusers model class's constructor (its settings and defaults)."""
    params = inspect.signature(cls.__init__).parameters
    return {k: p for k, p in params.items() if k != "self"}


def config_mismatch(transformer: nn.Module, config: dict, params: dict) -> list[str]:
    """The init settings (`params`: init_params of its class) in a folder's `config` that the built
    `transformer` does not have."""
    return [f"{k}: folder {v!r} vs built {transformer.config.get(k)!r}" for k, v in config.items()
            if k in params and _plain(v) != _plain(transformer.config.get(k))]


class DiffusersTransformer(nn.Module):
    """A diffusers transformer with `transformer_blocks` and `proj_out`. Subclasses build it, set
    PARALLEL_LIMITS ({parallel dimension: why not}) and write forward()."""

    PARALLEL_LIMITS: dict[str, str] = {}

    def __init__(self, cfg, transformer: nn.Module):
        super().__init__()
        self.cfg = cfg
        self.transformer = transformer
        self.reset_parameters()
        self._flops: dict[tuple, int] = {}

    def reset_parameters(self) -> None:
        """Zero the output projection, so that the untrained model predicts 0, as the DiT's zero
        final layer does (a folder's weights replace it)."""
        nn.init.zeros_(self.transformer.proj_out.weight)
        nn.init.zeros_(self.transformer.proj_out.bias)

    @property
    def blocks(self) -> list[nn.Module]:
        """The transformer blocks in forward order: the units of activation checkpointing and of
        FSDP sharding."""
        return list(self.transformer.transformer_blocks)

    def parallel_limits(self) -> dict[str, str]:
        """{parallel dimension: why this wrapper cannot use it} (common/parallel/layouts.py)."""
        return dict(self.PARALLEL_LIMITS)

    def flops_per_sample(self, height: int | None = None, width: int | None = None,
                         text_len: int | None = None) -> int:
        """Forward FLOPs per sample (2 per multiply-add) of matmuls and attention, counted once per
        shape by torch.utils.flop_counter on a meta-device copy. Training is about 3x this."""
        return denoiser_flops(self, height, width, text_len)
