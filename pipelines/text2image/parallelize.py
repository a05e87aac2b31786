"""How common.parallel applies to the text2image DiT: each DiT block is one FSDP unit."""
from __future__ import annotations

from common.config import ParallelConfig
from common.dist import DistInfo
from common.parallel.data_parallel import apply_data_parallel


def parallelize(model, cfg: ParallelConfig, info: DistInfo):
    return apply_data_parallel(model, list(model.blocks), info, cfg)
