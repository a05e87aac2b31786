"""Frozen modules in checkpoints: which are saved, and how the others (pretrained towers loaded from
a local folder) are pinned by a fingerprint of their weights instead (common/checkpoint.py writes
and loads both)."""
from __future__ import annotations

import torch

from common.checkpoint import CheckpointError


def weights_fingerprint(module: torch.nn.Module) -> str:
    """An identity of a module's weights, read from the tensors themselves (not their files, so a
    copy of the folder on another node or an fp32 re-save of the same values matches): per tensor
    its name, dtype, shape and the wrap-around int64 sum of its raw bytes, read 8 at a time where
    the size allows (~10 GB/s on two CPU cores: SD3's 22 GB text stack in ~2 s). Integer sums do
    not depend on reduction order, so every device and thread count gives the same string; a
    change of any value changes its tensor's sum."""
    import hashlib
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    digest = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        flat = t.detach().contiguous().reshape(-1)
        raw = flat.view(torch.uint8)
        if raw.numel() % 8 == 0:
            bits = (raw if raw.data_ptr() % 8 == 0 else raw.clone()).view(torch.int64)
        else:
            bits = flat.view(ints[flat.element_size()])
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|{int(bits.sum(dtype=torch.int64))}\n".encode())
    return digest.hexdigest()[:16]


class FrozenModules:
    """A run's frozen modules as checkpoints hold them. One whose `weights_folder` attribute names
    the local folder it was loaded from (a pretrained text encoder: T5-XXL alone is ~19 GB in
    fp32) is not saved in every checkpoint: meta.json records its folder and the fingerprint of
    its weights, and a resume or load refuses a checkpoint whose fingerprint differs from the
    weights now loaded from that folder. The others (random towers, trained codecs) are saved."""

    def __init__(self, modules: dict[str, torch.nn.Module] | None):
        modules = modules or {}
        self.saved = {n: m for n, m in modules.items() if not getattr(m, "weights_folder", "")}
        self.from_folders = {n: {"folder": m.weights_folder, "fingerprint": weights_fingerprint(m)}
                             for n, m in modules.items() if getattr(m, "weights_folder", "")}

    def state(self) -> dict[str, dict[str, torch.Tensor]]:
        return {name: dict(m.state_dict()) for name, m in self.saved.items()}

    def check(self, path: str, meta: dict) -> None:
        """Refuse checkpoint `path` (its meta.json: `meta`) when a frozen module it was trained with
        came from a folder whose weights differ from this run's. Checkpoints written before these
        fingerprints existed saved such modules instead and pass."""
        recorded = meta.get("frozen_folders") or {}
        for name, now in self.from_folders.items():
            then = recorded.get(name)
            if then is not None and then["fingerprint"] != now["fingerprint"]:
                raise CheckpointError(
                    f"checkpoint {path} was trained with {name} weights from {then['folder']} (fingerprint "
                    f"{then['fingerprint']}); {now['folder']} now holds other weights (fingerprint "
                    f"{now['fingerprint']}): put the weights it was trained on back in {now['folder']}")
