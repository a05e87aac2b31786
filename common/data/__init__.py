"""WebDataset streaming loader: one global deterministic order, DP-rank slices, exact resume."""

from .buckets import BucketPlanner, Buckets, resize_crop, sample_shape
from .loader import StreamingLoader, default_collate
from .mixing import MixedOrder, MixSchedule
from .order import GlobalOrder, ResampledOrder
from .shards import DataError, ShardIndex, expand_shards

__all__ = ["BucketPlanner", "Buckets", "DataError", "GlobalOrder", "MixSchedule", "MixedOrder",
           "ResampledOrder", "ShardIndex", "StreamingLoader", "default_collate", "expand_shards",
           "resize_crop", "sample_shape"]
