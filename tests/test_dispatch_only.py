"""Models reach attention, norms and RoPE only through common.kernels' dispatch, so a backend
choice (Triton, SDPA, reference) applies everywhere and FLOP counting sees every call."""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIRECT = re.compile(r"scaled_dot_product_attention|F\.layer_norm|F\.rms_norm|flash_attn_func|nn\.MultiheadAttention")


def test_no_direct_attention_or_norm_calls_outside_kernels():
    offenders = []
    for top in ("pipelines", "common"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            if os.path.join(ROOT, "common", "kernels") in dirpath:
                continue
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    for i, line in enumerate(open(path, encoding="utf-8"), 1):
                        if DIRECT.search(line):
                            offenders.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
