"""Checkpoint and data integrity: RNG state without pickle, the loader's resume identity,
retention after a resume from an older step, atomic re-saves with fsync, and run seeds over the
whole [0, 2^63) range."""
from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import pytest
import torch
import webdataset as wds

from common.checkpoint import CheckpointError, CheckpointManager, latest_complete
from common.config import ConfigError
from common.data import DataError, StreamingLoader
from common.dist import DistInfo

INFO = DistInfo(0, 1, 0, torch.device("cpu"))


def _model_opt():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    return m, opt


def _draws():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


# --------------------------------------------------------------------------- RNG state
def test_rng_state_is_tensors_and_json_loaded_without_pickle(tmp_path):
    m, opt = _model_opt()
    random.seed(5), np.random.seed(6), torch.manual_seed(7)
    random.gauss(0, 1), np.random.randn()  # cached gaussians are part of the state too
    mgr = CheckpointManager(str(tmp_path), keep_last=2, signature={}, info=INFO)
    path = mgr.save(1, m, opt, {}, {})
    expected = _draws()
    tensors = torch.load(os.path.join(path, "rng_rank0.pt"), weights_only=True)
    assert all(isinstance(t, torch.Tensor) for t in tensors.values()) and tensors["torch"].dtype == torch.uint8
    with open(os.path.join(path, "rng_rank0.json")) as f:
        json.load(f)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    mgr.load(path, m, opt, {})
    assert _draws() == expected


class _RunsCode:
    """A pickle that creates a file when unpickled: what a hostile checkpoint could hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_pickled_rng_file_is_refused_never_unpickled(tmp_path):
    m, opt = _model_opt()
    mgr = CheckpointManager(str(tmp_path / "ck"), keep_last=2, signature={}, info=INFO)
    path = mgr.save(1, m, opt, {}, {})
    marker = tmp_path / "code_ran"
    for f in os.listdir(path):
        if f.startswith("rng_rank"):
            os.remove(os.path.join(path, f))
    # The layout before RNG state became tensors + JSON: one pickle per rank.
    torch.save({"python": _RunsCode(str(marker))}, os.path.join(path, "rng_rank0.pt"))
    with pytest.raises(CheckpointError, match="pickle.*convert-rng"):
        mgr.load(path, m, opt, {})
    assert not marker.exists()


def test_legacy_rng_file_converts_on_request_and_then_resumes_exactly(tmp_path):
    from common.checkpoint import convert_legacy_rng
    m, opt = _model_opt()
    mgr = CheckpointManager(str(tmp_path), keep_last=2, signature={}, info=INFO)
    path = mgr.save(1, m, opt, {}, {})
    for f in os.listdir(path):
        if f.startswith("rng_rank"):
            os.remove(os.path.join(path, f))
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    legacy = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(legacy, os.path.join(path, "rng_rank0.pt"))  # what checkpoints held before
    expected = _draws()
    assert convert_legacy_rng(path) == 1
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    mgr.load(path, m, opt, {})
    assert _draws() == expected


# --------------------------------------------------------------------------- loader identity
PER_SHARD, NUM_SHARDS = 6, 4


def _shards(d, prefix="s"):
    d.mkdir()
    for s in range(NUM_SHARDS):
        with wds.TarWriter(str(d / f"shard-{s:06d}.tar")) as w:
            for k in range(PER_SHARD):
                w.write({"__key__": f"{prefix}{s * PER_SHARD + k:05d}", "txt": b"x"})
    return d


def _loader(d, **kw):
    kw.setdefault("window", 2)
    return StreamingLoader(str(d), lambda s: {"txt": s["txt"]}, 2, num_workers=0, **kw)


def test_loader_resume_refuses_other_dataset_shuffle_or_window(tmp_path):
    a = _shards(tmp_path / "a")
    b = _shards(tmp_path / "b", prefix="t")  # same shard names and sizes, other samples
    src = _loader(a)
    next(iter(src))
    sd = src.state_dict()
    for other, needle in [(_loader(b), "dataset changed"), (_loader(a, shuffle=False), "shuffle"),
                          (_loader(a, window=3), "shuffle_window")]:
        with pytest.raises(DataError, match=needle) as e:
            other.load_state_dict(sd)
        assert "\n" not in str(e.value)
    moved = shutil.copytree(a, tmp_path / "moved")  # the same shards at another path resume
    ld = _loader(moved)
    ld.load_state_dict(sd)
    assert ld.samples_consumed == 2


# --------------------------------------------------------------------------- retention, atomicity
def _steps(root):
    return sorted(int(d[5:]) for d in os.listdir(root) if d.startswith("step_") and d[5:].isdigit())


def test_retention_after_resume_from_an_older_step(tmp_path):
    m, opt = _model_opt()
    first = CheckpointManager(str(tmp_path), keep_last=3, signature={}, info=INFO)
    for step in (2, 4, 6):
        first.save(step, m, opt, {}, {"timeline": "old"})
    mgr = CheckpointManager(str(tmp_path), keep_last=1, signature={}, info=INFO)
    mgr.load(str(tmp_path / "step_00000002"), m, opt, {})
    written = mgr.save(3, m, opt, {}, {"timeline": "new"})
    assert os.path.isdir(written) and latest_complete(str(tmp_path)) == written
    assert mgr.resolve("auto") == written
    assert _steps(tmp_path) == [3, 4, 6]  # the abandoned 4 and 6 stay while the new run is behind
    mgr.save(5, m, opt, {}, {"timeline": "new"})
    assert _steps(tmp_path) == [5, 6]      # 4 was passed: gone, with 3 (keep_last=1)
    mgr.save(6, m, opt, {}, {"timeline": "new"})
    assert _steps(tmp_path) == [6]
    assert json.load(open(tmp_path / "step_00000006" / "meta.json"))["timeline"] == "new"


def test_resave_of_a_step_is_atomic(tmp_path, monkeypatch):
    m, opt = _model_opt()
    mgr = CheckpointManager(str(tmp_path), keep_last=2, signature={}, info=INFO)
    mgr.save(4, m, opt, {}, {"copy": "first"})
    real_rename = os.rename

    class Killed(Exception):
        pass

    def rename(src, dst):
        name = os.path.basename(str(src))
        if name.startswith("step_") and name.endswith(".tmp"):  # killed before the new copy is renamed in
            raise Killed
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(Killed):
        mgr.save(4, m, opt, {}, {"copy": "second"})
    monkeypatch.setattr(os, "rename", real_rename)
    again = CheckpointManager(str(tmp_path), keep_last=2, signature={}, info=INFO)  # the restart
    path = again.resolve("auto")
    assert path is not None and path.endswith("step_00000004")
    assert json.load(open(os.path.join(path, "meta.json")))["copy"] == "first"
    assert _steps(tmp_path) == [4] and not [d for d in os.listdir(tmp_path) if d.endswith(".old")]
    again.save(4, m, opt, {}, {"copy": "second"})
    assert json.load(open(os.path.join(path, "meta.json")))["copy"] == "second"
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000004"]


def test_rng_files_and_directories_are_fsynced(tmp_path, monkeypatch):
    m, opt = _model_opt()
    mgr = CheckpointManager(str(tmp_path), keep_last=2, signature={}, info=INFO)
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.path.realpath(os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    final = mgr.save(1, m, opt, {}, {})
    root = os.path.realpath(tmp_path)
    tmp = os.path.realpath(final) + ".tmp"
    assert any(p in (os.path.join(tmp, "rng_rank0.pt"), os.path.join(final, "rng_rank0.pt")) for p in synced)
    assert tmp in synced or os.path.realpath(final) in synced  # the checkpoint's own entries
    assert synced.count(root) >= 2                             # the rename, then `latest`


# --------------------------------------------------------------------------- seeds
def test_per_sample_seeds_cover_every_run_seed():
    from common.diffusion.noise import per_sample_randn, sample_seeds
    pos = torch.arange(4) + 1000
    assert torch.equal(sample_seeds(7, pos), pos + (7 << 40))  # small seeds: the noise of existing runs
    seen = set()
    for run_seed in (0, 5, 2**23 - 1, 2**23, 2**23 + 5, 2**24 + 5, 2**31 - 1, 2**62, 2**63 - 1):
        s = sample_seeds(run_seed, pos)
        assert s.dtype == torch.long and bool((s >= 0).all()), run_seed
        assert per_sample_randn(s, (2,)).shape == (4, 2)
        seen.add(tuple(s.tolist()))
    assert len(seen) == 9  # no two run seeds share their per-sample seeds (5 vs 2^24+5 did)


def test_run_seed_range_is_checked():
    from common.config import build_config
    from pipelines.text2image.config import T2IConfig
    from tests.conftest import TINY_YAML
    assert build_config(T2IConfig, TINY_YAML, [f"run.seed={2**63 - 1}"]).run.seed == 2**63 - 1
    for bad in (-1, 2**63):
        with pytest.raises(ConfigError, match=r"run\.seed=.*\[0, 2\^63\)"):
            build_config(T2IConfig, TINY_YAML, [f"run.seed={bad}"])
