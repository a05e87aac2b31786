"""Drops the start-up messages that the pinned third-party versions print on import and that say
nothing to a user of this project (each entry says why it is safe). Only records of the named
logger that contain the fragment are dropped; every other message of those loggers still shows.
Installed when `common` is imported, before any pipeline imports diffusers or torchao."""
from __future__ import annotations

import logging

# (logger, message fragment, why dropping it hides nothing)
KNOWN_NOISE: tuple[tuple[str, str, str], ...] = (
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported by torch.compile",
     "torchao 0.18 registers its config enums with pytree, a call torch 2.14 deprecates; "
     "it is torchao's to change and does not affect what it computes"),
    ("diffusers.quantizers.torchao.torchao_quantizer", "Unable to import `torchao` Tensor objects",
     "diffusers 0.42 looks for tensor classes that torchao 0.18 no longer has; they matter only for "
     "loading torchao-quantized diffusers checkpoints, which the project neither writes nor reads"),
)


class DropMessage(logging.Filter):
    def __init__(self, fragment: str):
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


def install() -> None:
    """Idempotent: one filter per (logger, fragment)."""
    for name, fragment, _ in KNOWN_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessage) and f.fragment == fragment for f in logger.filters):
            logger.addFilter(DropMessage(fragment))
