"""bench/lowp_loss.py, the low-precision loss comparison the GPU check runs as its step 6.

Its recipes run at once on a GPU: concurrency must not change a recipe's losses (same samples and
noise), each recipe is compared with the baseline whichever ends first, and a recipe that fails is
recorded with its error instead of losing the others."""
from __future__ import annotations

import json

import pytest

from tests.test_peer_bench import load_bench


@pytest.mark.slow  # ~40 s: four short training runs of the tiny config
def test_recipes_run_concurrently_with_the_losses_of_a_sequential_run(tmp_path):
    bench = load_bench("lowp_loss")
    # 12 steps after a 2-step warmup: the DiT's zero-initialised output layer makes the first losses
    # equal in every recipe, until the quantised blocks' gradients have moved it
    common = ["--steps", "12", "--recipes", "int8,fp32", "--baseline", "fp32", "--count", "64",
              "--set", "data.num_workers=0", "optim.warmup_steps=2"]
    assert bench.main([*common, "--parallel", "2", "--json", str(tmp_path / "par.json")]) == 0
    assert bench.main([*common, "--parallel", "1", "--json", str(tmp_path / "seq.json")]) == 0
    par = json.loads((tmp_path / "par.json").read_text())
    seq = json.loads((tmp_path / "seq.json").read_text())
    assert par["baseline"] == "fp32" and list(par["results"]) == ["fp32", "int8"]  # baseline first
    for name in ("fp32", "int8"):
        p, s = par["results"][name], seq["results"][name]
        assert p["status"] == s["status"] == "ok", (p, s)
        assert p["final_loss"] == s["final_loss"], name
    int8 = par["results"]["int8"]
    assert "linears converted" in int8["converted"]
    assert int8["loss_vs_baseline"] == pytest.approx(int8["final_loss"] / par["results"]["fp32"]["final_loss"] - 1)
    assert abs(int8["loss_vs_baseline"]) < 0.2 and int8["loss_vs_baseline"] != 0.0


def test_a_failing_recipe_is_recorded_with_its_error(tmp_path):
    bench = load_bench("lowp_loss")
    out = tmp_path / "fail.json"
    rc = bench.main(["--steps", "2", "--recipes", "fp32,int8", "--count", "32", "--parallel", "2",
                     "--set", "model.preset=no_such_preset", "--json", str(out)])
    assert rc == 1
    res = json.loads(out.read_text())["results"]
    assert set(res) == {"fp32", "int8"}
    for r in res.values():
        assert r["status"] == "failed" and "no_such_preset" in r["log_tail"], r


@pytest.mark.slow  # ~40 s: four short training runs of the tiny config
def test_seeds_pair_each_recipe_with_the_baseline_of_its_seed(tmp_path):
    bench = load_bench("lowp_loss")
    common = ["--steps", "8", "--recipes", "fp32,int8", "--baseline", "fp32", "--count", "64", "--parallel", "2",
              "--set", "data.num_workers=0", "optim.warmup_steps=2"]
    assert bench.main([*common, "--seeds", "3,4", "--json", str(tmp_path / "two.json")]) == 0
    assert bench.main([*common, "--seeds", "4", "--json", str(tmp_path / "one.json")]) == 0
    two, one = (json.loads((tmp_path / f).read_text()) for f in ("two.json", "one.json"))
    assert two["seeds"] == [3, 4] and list(two["results"]) == ["fp32", "int8"]
    fp32, int8 = two["results"]["fp32"], two["results"]["int8"]
    assert fp32["status"] == int8["status"] == "ok"
    # each seed is its own run: seed 4 alone gives the same losses as seed 4 among two
    assert int8["seeds"]["4"]["final_loss"] == one["results"]["int8"]["final_loss"]
    assert fp32["seeds"]["3"]["final_loss"] != fp32["seeds"]["4"]["final_loss"]
    gaps = [int8["seeds"][s]["final_loss"] / fp32["seeds"][s]["final_loss"] - 1 for s in ("3", "4")]
    assert int8["loss_vs_baseline"] == pytest.approx(sum(gaps) / 2)
    assert int8["loss_vs_baseline_range"] == pytest.approx([min(gaps), max(gaps)])
    seed_losses = [fp32["seeds"][s]["final_loss"] for s in ("3", "4")]
    assert fp32["final_loss"] == pytest.approx(sum(seed_losses) / 2)
    with pytest.raises(SystemExit):  # argparse's error: exit 2 with the message
        bench.main([*common, "--seeds", "1,x"])
