"""Checkpoint manager: atomic visibility, `latest`, retention, signature checks, exact round trip."""
from __future__ import annotations

import os

import pytest
import torch

from common.checkpoint import CheckpointError, CheckpointManager, latest_complete
from common.dist import DistInfo

INFO = DistInfo(0, 1, 0, torch.device("cpu"))


def _model_opt(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    return m, opt


def test_round_trip_is_exact(tmp_path):
    m, opt = _model_opt(0)
    extra = {"ema": {"w": torch.randn(5)}}
    mgr = CheckpointManager(str(tmp_path), keep_last=2, signature={"model": "a"}, info=INFO)
    path = mgr.save(3, m, opt, extra, {"loader": {"samples_consumed": 12}})
    m2, opt2 = _model_opt(1)
    extra2 = {"ema": {"w": torch.zeros(5)}}
    meta = mgr.load(path, m2, opt2, extra2)
    assert meta["step"] == 3 and meta["loader"]["samples_consumed"] == 12
    for a, b in zip(m.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(extra["ema"]["w"], extra2["ema"]["w"])
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[k]["exp_avg"], s2[k]["exp_avg"]) for k in s1)


def test_half_written_checkpoint_is_never_picked(tmp_path):
    m, opt = _model_opt()
    mgr = CheckpointManager(str(tmp_path), keep_last=3, signature={}, info=INFO)
    good = mgr.save(2, m, opt, {}, {})
    # A save that died: its .tmp folder, and even a step folder without meta.json.
    os.makedirs(tmp_path / "step_00000004.tmp")
    (tmp_path / "step_00000004.tmp" / "__0_0.distcp").write_bytes(b"partial")
    os.makedirs(tmp_path / "step_00000006")
    assert mgr.resolve("auto") == good
    (tmp_path / "latest").write_text("step_00000006\n")  # pointer to an incomplete one
    assert latest_complete(str(tmp_path)) == good
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        mgr.resolve(str(tmp_path / "step_00000006"))


def test_retention_and_latest(tmp_path):
    m, opt = _model_opt()
    mgr = CheckpointManager(str(tmp_path), keep_last=2, signature={}, info=INFO)
    for step in (1, 2, 3, 4):
        mgr.save(step, m, opt, {}, {})
    kept = sorted(d for d in os.listdir(tmp_path) if d.startswith("step_"))
    assert kept == ["step_00000003", "step_00000004"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000004"
    assert mgr.resolve("none") is None


def test_other_model_is_refused_before_loading(tmp_path):
    m, opt = _model_opt()
    CheckpointManager(str(tmp_path), 1, {"pipeline": "text2image", "depth": 2}, INFO).save(1, m, opt, {}, {})
    other = CheckpointManager(str(tmp_path), 1, {"pipeline": "text2image", "depth": 4}, INFO)
    with pytest.raises(CheckpointError, match="another model.*depth"):
        other.load(other.resolve("auto"), m, opt, {})
    with pytest.raises(CheckpointError, match="not found"):
        other.resolve(str(tmp_path / "nope"))


def test_weights_fingerprint_sees_one_ulp_and_nothing_else():
    """The fingerprint of a folder-loaded frozen module: equal for an equal copy (other thread
    count, other parameter order), different after one value moves by one ulp, after two tensors
    swap, or when a value changes dtype."""
    from common.frozen_weights import weights_fingerprint
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    fp = weights_fingerprint(m)
    copy = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    copy.load_state_dict(m.state_dict())
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert weights_fingerprint(copy) == fp
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        w = copy[1].weight
        w[17, 3] = torch.nextafter(w[17, 3], torch.tensor(float("inf")))
    assert weights_fingerprint(copy) != fp
    swapped = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    swapped[0].load_state_dict(m[1].state_dict())
    swapped[1].load_state_dict(m[0].state_dict())
    assert weights_fingerprint(swapped) != fp
    assert weights_fingerprint(m.double()) != fp


def test_folder_loaded_frozen_module_is_fingerprinted_not_saved(tmp_path):
    """A frozen module with `weights_folder` leaves no tensors in the checkpoint; its fingerprint
    in meta.json lets a load with the same weights pass and refuses other weights in one line. A
    module without the attribute is saved and restored."""
    import torch.distributed.checkpoint as dcp

    from common.checkpoint import read_meta
    from common.frozen_weights import FrozenModules

    class FromFolder(torch.nn.Linear):
        weights_folder = "/models/t5"

    m, opt = _model_opt(0)
    torch.manual_seed(1)
    tower, random_tower = FromFolder(4, 4), torch.nn.Linear(4, 4)
    frozen = FrozenModules({"text_encoder": tower, "codec": random_tower})
    assert set(frozen.saved) == {"codec"}
    mgr = CheckpointManager(str(tmp_path), keep_last=2, signature={"model": "a"}, info=INFO)
    path = mgr.save(1, m, opt, frozen.state(), {"frozen_folders": frozen.from_folders})
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert any(k.startswith("codec.") for k in keys) and not any(k.startswith("text_encoder") for k in keys)
    meta = read_meta(path)
    assert meta["frozen_folders"]["text_encoder"]["folder"] == "/models/t5"
    FrozenModules({"text_encoder": tower}).check(path, meta)  # same weights: passes
    with torch.no_grad():
        tower.weight[0, 0] += 1e-3
    with pytest.raises(CheckpointError, match="now holds other weights") as e:
        FrozenModules({"text_encoder": tower}).check(path, meta)
    assert meta["frozen_folders"]["text_encoder"]["fingerprint"] in str(e.value) and "\n" not in str(e.value)
    FrozenModules({"text_encoder": tower}).check(path, {})  # written before fingerprints: passes
    # A checkpoint of that time saved the tower's tensors: it loads, and the folder's tower is kept.
    from common.checkpoint import load_for_inference
    old = mgr.save(2, m, opt, {"text_encoder": dict(random_tower.state_dict())}, {})
    m2, kept = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)), tower.weight.clone()
    load_for_inference(old, m2, {"text_encoder": tower}, {"model": "a"}, use_ema=False)
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values()))
    assert torch.equal(tower.weight, kept)
