"""The start-up messages common.import_noise drops: gone after `import common`, present without it
(so each entry still names a message the pinned versions print), and nothing else of those
loggers is hidden."""
from __future__ import annotations

import subprocess
import sys

import pytest

from common.import_noise import KNOWN_NOISE
from tests.conftest import ROOT

IMPORTS = "import diffusers; from diffusers import AutoencoderKL"  # pulls in torchao through diffusers
OTHERS = "; ".join(f"logging.getLogger({name!r}).warning('unrelated message {i}')"
                   for i, (name, _, _) in enumerate(KNOWN_NOISE))


def stderr_of(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr


@pytest.mark.slow
def test_known_import_messages_are_dropped_and_nothing_else():
    bare = stderr_of(f"import logging; {IMPORTS}")
    for _, fragment, _ in KNOWN_NOISE:
        assert fragment in bare, f"the pinned versions no longer print {fragment!r}: drop its entry"
    quiet = stderr_of(f"import logging, common; {IMPORTS}; {OTHERS}")
    for i, (_, fragment, _) in enumerate(KNOWN_NOISE):
        assert fragment not in quiet, quiet[-2000:]
        assert f"unrelated message {i}" in quiet
