"""train.host_malloc: glibc keeps freed memory, so large per-step buffers stop page-faulting."""
from __future__ import annotations

import subprocess
import sys

import pytest

from common.config import ConfigError, build_config
from common.host_memory import _glibc, apply_host_malloc
from pipelines.text2image.config import T2IConfig

# A child process (mallopt is process-wide): allocate and fill a 64 MB tensor 16 times, freeing it
# in between, and print the minor page faults of each fill.
FAULTS = """
import resource, sys, torch
from common.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
faults = []
for i in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.ones(16 * 2**20)  # 64 MB: above glibc's largest mmap threshold (32 MB)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del t
print(*faults)
"""


def _faults(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True)
    return [int(v) for v in out.stdout.split()]


@pytest.mark.skipif(_glibc() is None, reason="mallopt settings are glibc's")
def test_keep_freed_memory_stops_refaulting_a_large_buffer():
    pages = 64 * 2**20 // 4096
    # glibc's default: every fill maps fresh pages, one fault per 4 KB page (16,384), every time.
    assert min(_faults("default")) >= pages // 2
    # kept: the heap grows for the first few fills (an aligned request is a little larger than the
    # chunk freed before it, until freed chunks coalesce: ~7 on glibc 2.36), then reuses its pages.
    assert max(_faults("keep")[-4:]) < pages // 16


def test_modes():
    assert apply_host_malloc("default", "cpu") is False
    assert apply_host_malloc("auto", "cuda") is False  # a GPU run keeps glibc's default
    with pytest.raises(ValueError, match="host_malloc must be one of auto, keep, default"):
        apply_host_malloc("jemalloc", "cpu")
    with pytest.raises(ConfigError, match="train.host_malloc='jemalloc' is not one of auto, keep, default"):
        build_config(T2IConfig, None, ["train.host_malloc=jemalloc"])
