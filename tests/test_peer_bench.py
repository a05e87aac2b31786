"""The peer benchmarks' harness (bench/peer_rounds.py) and the text2video peer's dimensions.

No timing is asserted: a fake clock that each fake step advances by a known amount checks that the
harness reports ours / peer (not the inverse) and alternates which side goes first."""
from __future__ import annotations

import importlib.util
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_bench(name: str):
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "bench", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeSide:
    def __init__(self, name: str, batch: int, seconds_per_step: float, clock: FakeClock, log: list):
        self.name, self.batch, self.seconds, self.clock, self.log = name, batch, seconds_per_step, clock, log

    def step(self) -> None:
        self.log.append(self.name)
        self.clock.now += self.seconds


def test_alternate_reports_ours_over_peer_and_alternates_the_order(monkeypatch):
    rounds = load_bench("peer_rounds")
    clock, log = FakeClock(), []
    monkeypatch.setitem(rounds.CLOCKS, "fake", clock)
    ours = FakeSide("ours", 8, 0.1, clock, log)    # 80 samples/s
    peer = FakeSide("peer", 8, 0.2, clock, log)    # 40 samples/s
    out = rounds.alternate(ours, peer, rounds=4, steps=2, clock="fake", warmup=1)
    assert out["ratio"] == pytest.approx(2.0) and out["ratio_best_rounds"] == pytest.approx(2.0)
    assert out["ours_samples_per_s"] == pytest.approx(80.0) and out["peer_samples_per_s"] == pytest.approx(40.0)
    timed = log[2:]  # after one warm-up step each
    firsts = [timed[i * 4] for i in range(4)]
    assert firsts == ["ours", "peer", "ours", "peer"]
    assert len(out["rounds_ours"]) == len(out["rounds_peer"]) == 4


def test_alternate_takes_medians_and_best_rounds(monkeypatch):
    rounds = load_bench("peer_rounds")
    clock = FakeClock()
    monkeypatch.setitem(rounds.CLOCKS, "fake", clock)

    class Scripted:
        def __init__(self, batch, durations):
            self.batch, self.durations = batch, iter(durations)

        def step(self):
            clock.now += next(self.durations)

    # one step per round, no warm-up: rates 10, 5, 20 (ours) and 10, 10, 4 (peer)
    ours, peer = Scripted(10, [1.0, 2.0, 0.5]), Scripted(10, [1.0, 1.0, 2.5])
    out = rounds.alternate(ours, peer, rounds=3, steps=1, clock="fake", warmup=0)
    assert out["ratio"] == pytest.approx(10 / 10)
    assert out["ratio_best_rounds"] == pytest.approx(20 / 10)
    # each round's own ratio: 10/10, 5/10, 20/4; their quartiles stay within them
    assert out["round_ratio_quartiles"] == pytest.approx([0.75, 1.0, 3.0])
    assert rounds.ratio_text(out) == "ratio 1.00x (best rounds 2.00x; middle half of the rounds 0.75-3.00x)"


def test_kernel_split_counts_only_the_shared_kernels():
    rounds = load_bench("peer_rounds")
    import torch

    class Side:
        batch = 4

        def step(self):
            a = torch.randn(128, 128)
            for _ in range(4):
                a = torch.mm(a, a) / 128 + 1.0  # a shared kernel (mm) and glue (div, add)

    out = rounds.kernel_split(Side(), steps=3)
    assert set(out["by_kernel_s"]) == {"aten::mm"}
    assert {"aten::div", "aten::add"} <= set(out["top_other_s"]) and "aten::mm" not in out["top_other_s"]
    assert 0 < out["shared_kernels_s"] < out["step_s"]
    assert 0 < out["other_ops_s"] and out["shared_kernels_s"] + out["other_ops_s"] < out["step_s"]
    # peer step 0.3 s of which 0.2 s shared; ours 0.25 s of which 0.15 s shared
    c = rounds.split_ceilings({"step_s": 0.25, "shared_kernels_s": 0.15}, {"step_s": 0.3, "shared_kernels_s": 0.2})
    assert c["ceiling_no_overhead"] == pytest.approx(2.0) and c["ceiling_peer_kernels"] == pytest.approx(1.5)


def test_op_timer_sees_backward_ops_once_each():
    # The split's timer must count the backward's kernels (autograd runs them on this thread) and
    # time each op once: linear decomposes to addmm forward, and its backward is two mm calls.
    rounds = load_bench("peer_rounds")
    import torch
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(16, 64, requires_grad=True)
    timer = rounds._OpTimer()
    with timer:
        lin(x).sum().backward()
    assert timer.calls["aten::addmm"] == 1 and timer.calls["aten::mm"] == 2
    assert "aten::linear" not in timer.calls and all(v >= 0 for v in timer.seconds.values())


def test_video_peer_has_our_dimensions():
    pytest.importorskip("diffusers")
    bench = load_bench("t2v_vs_diffusers")
    ours = bench.Ours([], batch=2)
    m, peer = ours.model.cfg, bench.peer_model(ours.model.cfg)
    c = peer.config
    assert tuple(c.patch_size) == (m.temporal_patch, m.patch_size, m.patch_size)
    assert (c.num_attention_heads, c.attention_head_dim, c.num_layers) == (m.heads, m.hidden // m.heads, m.depth)
    assert (c.in_channels, c.text_dim, c.ffn_dim) == (m.in_channels, m.text_dim, m.hidden * 4)
    ours_params = sum(p.numel() for p in ours.model.parameters())
    peer_params = sum(p.numel() for p in peer.parameters())
    assert abs(ours_params / peer_params - 1) < 0.05, (ours_params, peer_params)
    # both sides train on the same clip shape and produce a finite loss
    assert ours.shape == (m.in_channels, m.frames, m.height, m.width)
    assert math.isfinite(ours.step()) and math.isfinite(bench.Peer(ours).step())


def test_run_configs_refuses_unknown_names_and_writes_each_config_row(monkeypatch, tmp_path, capsys):
    import argparse
    import json
    from types import SimpleNamespace

    import torch
    rounds = load_bench("peer_rounds")
    clock = FakeClock()
    monkeypatch.setitem(rounds.CLOCKS, "fake", clock)
    monkeypatch.setattr(rounds, "setup_process", lambda args: None)
    seen = []

    def compare(name, args, steps):
        seen.append((name, steps))
        ours = FakeSide("ours", 4, 0.1 * (1 + len(seen)), clock, [])
        ours.model = torch.nn.Linear(3, 2)  # 8 parameters
        ours.cfg = SimpleNamespace(parallel=SimpleNamespace(compile=False))
        peer = FakeSide("peer", 4, 0.1, clock, [])
        peer.params = 5
        return rounds.measure(ours, lambda o: peer, {"config": name}, args, steps)

    def parser(*argv):
        p = argparse.ArgumentParser()
        rounds.add_arguments(p, configs="a,b", batch=4, json_name="x.json", root=str(tmp_path))
        monkeypatch.setattr(sys, "argv", ["bench", "--clock", "fake", "--rounds", "2", *argv])
        return p

    rows = rounds.run_configs(parser(), {"a": [], "b": []}, compare, lambda name: {"a": 3, "b": 1}[name],
                              lambda r: f"{r['config']}: ")
    assert seen == [("a", 3), ("b", 1)]  # each config's own default steps
    assert [r["ratio"] for r in rows] == pytest.approx([0.5, 1 / 3])  # ours / peer
    assert [(r["params_ours"], r["params_peer"], r["batch"]) for r in rows] == [(8, 5, 4)] * 2
    written = json.load(open(tmp_path / "bench" / "results" / "x.json"))
    assert [r["config"] for r in written["rows"]] == ["a", "b"] and written["clock"] == "fake"
    assert "a: ratio 0.50x" in capsys.readouterr().out

    seen.clear()
    with pytest.raises(SystemExit):
        rounds.run_configs(parser("--configs", "a,c"), {"a": [], "b": []}, compare, lambda name: 1, str)
    assert seen == [("a", 1)] and "unknown config 'c'" in capsys.readouterr().err
