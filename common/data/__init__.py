"""WebDataset streaming loader: one global deterministic order, DP-rank slices, exact resume."""

from .loader import StreamingLoader, default_collate
from .order import GlobalOrder
from .shards import DataError, ShardIndex, expand_shards

__all__ = ["DataError", "GlobalOrder", "ShardIndex", "StreamingLoader", "default_collate",
           "expand_shards"]
