"""glibc malloc settings for training processes that keep large tensors in host memory.

By default glibc serves each allocation above its mmap threshold (dynamic, at most 32 MB) with a
fresh mapping that it unmaps on free, and it trims the heap's free top back to the kernel. A step
that allocates and frees the same large activations every step then pays a page fault per 4 KB
page of each of them, every step: a CPU DiT-S step (batch 32, 50 MB MLP activations) took
~390,000 faults a step alone and 10.1-10.6 s, against none and 9.2-9.4 s with the settings below,
in 4 of 5 pairs of processes (the fifth: 9.8 s both); a GEMM writing a fresh 50 MB output runs at
136 against 181 GFLOPS (README, Performance).

keep_freed_memory() sets M_MMAP_MAX = 0 (every allocation from the heap; glibc still maps memory
where the heap cannot grow) and turns trimming off (M_TRIM_THRESHOLD = -1: freed memory stays
mapped for the next step). Resident memory then stays at the process's peak, which a training step reaches every step
anyway. LD_PRELOADing jemalloc or tcmalloc does the same for PyTorch on CPUs; this needs no
dependency. Process-wide: the training entrypoint calls it (train.host_malloc), an import never does.
"""
from __future__ import annotations

import ctypes
import platform

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h> parameter numbers
M_MMAP_MAX = -4
NO_TRIM = -1  # mallopt(3): an M_TRIM_THRESHOLD of -1 turns trimming off

MODES = ("auto", "keep", "default")


def _glibc():
    """The C library if it is glibc (it has mallopt and gnu_get_libc_version), else None."""
    if platform.system() != "Linux":
        return None
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols, its C library's among them
        libc.gnu_get_libc_version  # absent from musl and other C libraries
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Applies the settings above to this process. True if glibc accepted both; False where the C
    library is not glibc (nothing changed)."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, NO_TRIM))


def apply_host_malloc(mode: str, device_type: str) -> bool:
    """train.host_malloc: "keep" applies keep_freed_memory(); "auto" does so on CPU runs only (a
    GPU run's large tensors live in the CUDA caching allocator); "default" leaves glibc as it is.
    Returns whether the settings were applied."""
    if mode not in MODES:
        raise ValueError(f"host_malloc must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "default" or (mode == "auto" and device_type != "cpu"):
        return False
    return keep_freed_memory()
