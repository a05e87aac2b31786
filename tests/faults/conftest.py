"""Uninterrupted reference runs, made once per session and compared against by every fault test."""
from __future__ import annotations

import pytest

from tests.conftest import shared_once

from .harness import tail, train

REF_STEPS = 8


@pytest.fixture(scope="session")
def ref_single(synth_data, tmp_path_factory):
    """One process, REF_STEPS steps, a checkpoint every 2 steps (all kept)."""
    def build(run):
        proc = train(run, synth_data, f"train.steps={REF_STEPS}")
        assert proc.returncode == 0, tail(proc)
    return shared_once(tmp_path_factory, "faults-ref-single", build)
