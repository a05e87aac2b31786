"""The layout planner (common/plan) against the project's real models and measured CPU runs.

* parameter tables: names and shapes equal to the real DiT and Llama modules; FLOPs equal to the
  DiT's own estimate;
* bytes per rank: every rank of several layouts (FSDP, HSDP, DDP, TP, PP, CP, 4-D) parallelized
  in-process on torch's fake process group, with local shard sizes per parameter equal to the
  plan, and process groups equal to the plan's rank lists; gradients and AdamW state counted after
  real gloo steps;
* collective bytes of one step equal to bench/comm_volume.py's CommCounter (gloo, 2 and 4 ranks)
  for FSDP, TP, TP+SP, Ulysses CP, PP x FSDP and PP x TP+SP (with call counts for FSDP and PP);
* saved activations within 15% of bench/activation_memory.py's SavedTensorMeter measurement
  (none / selective / full checkpointing) and of a Llama with its loss;
* the CLI: ranked tables that fit, one-line errors, and the full-size dry run at 1,024 and
  10,240 ranks.
"""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from common.plan import source as plan_source
from common.plan.layout import Layout, activation_bytes, collectives, local_numel, owned_params, rank_param_numel
from common.plan.models import block_activation_elems, dit_desc, forward_flops, llama_desc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(name: str):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))


# --------------------------------------------------------------------------- model arithmetic
def test_parameter_tables_and_flops_match_the_real_models():
    from common.nn.llama import Llama, LlamaConfig
    from pipelines.text2image.model import DiT, dit_config
    cfg = dit_config("tiny", img_size=12, patch_size=2, in_channels=4, hidden=48, depth=3, heads=4, text_dim=24,
                     text_len=7, mlp_ratio=170 / 48)
    real = {n: tuple(p.shape) for n, p in DiT(cfg).named_parameters()}
    desc = dit_desc("t", hidden=48, depth=3, heads=4, mlp_ratio=cfg.mlp_ratio, text_dim=24, text_len=7,
                    tokens=cfg.num_tokens, patch_in=16, out_dim=16, patch_conv=(4, 2, 2))
    assert {p.name: p.shape for p in desc.params} == real
    assert forward_flops(desc) == DiT(cfg).flops_per_sample()
    lc = LlamaConfig(dim=64, n_layers=3, n_heads=8, n_kv_heads=2, vocab_size=96, ffn_hidden=160)
    ld = llama_desc("l", dim=64, n_layers=3, n_heads=8, kv_heads=2, ffn=160, vocab=96, seq_len=32)
    assert {p.name: p.shape for p in ld.params} == {n: tuple(p.shape) for n, p in Llama(lc).named_parameters()}
    # The 7B preset is Llama-2-7B's well-known 6.74B parameters.
    assert plan_source.resolve(None, None, (), "llama-7b").desc.num_params == 6_738_415_616


# --------------------------------------------------------------------------- shards per rank (fake PG)
def _tiny_dit_source():
    return plan_source.resolve("text2image", None, ["model.preset=tiny", "model.image_size=16", "model.patch_size=2",
                                                    "model.hidden=48", "model.depth=4", "model.heads=4",
                                                    "model.mlp_ratio=3.5", "text.width=24", "text.layers=1",
                                                    "text.heads=2", "text.context_length=8"])


def _tiny_llama_source():
    from common.nn.llama import LlamaConfig
    lc = LlamaConfig(dim=64, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=200, ffn_hidden=168, max_seq_len=64)
    desc = llama_desc("tiny llama", dim=64, n_layers=4, n_heads=8, kv_heads=4, ffn=168, vocab=200, seq_len=64)
    return plan_source.Source(desc, llama_cfg=lc, ema=False)


LAYOUTS = {
    "fsdp4": Layout(dp_shard=4),
    "hsdp2x3": Layout(dp_replicate=2, dp_shard=3),
    "ddp3": Layout(dp_replicate=3, dp_mode="ddp"),
    "tp2-fsdp3": Layout(dp_shard=3, tp=2),
    "pp2-fsdp3": Layout(pp=2, dp_shard=3, microbatches=2),
    "pp2-interleaved-ddp2": Layout(pp=2, dp_replicate=2, dp_mode="ddp", schedule="interleaved", stages_per_rank=2,
                                   microbatches=2),
    "cp2-tp2-fsdp2": Layout(dp_shard=2, cp=2, tp=2),
    "hsdp2x2-cp2": Layout(dp_replicate=2, dp_shard=2, cp=2),
    "pp2-dp2-cp2-tp2": Layout(pp=2, dp_shard=2, cp=2, tp=2, microbatches=2),
}


@pytest.mark.parametrize("which", [pytest.param("dit", marks=pytest.mark.slow), "llama"])
def test_every_rank_holds_exactly_the_planned_shards(which):
    import warnings

    import torch.distributed as dist

    from common.parallel.dims import submesh
    from common.plan.dry_run import GROUP_DIMS, MESH_NAMES, parallelize_rank
    src = _tiny_dit_source() if which == "dit" else _tiny_llama_source()
    prefix = "" if which == "dit" else "lm."
    checked = 0
    for name, lay in LAYOUTS.items():
        if which == "llama" and lay.dp_mode == "ddp":
            continue  # the VLM plan shards with FSDP only
        for rank in range(lay.world):
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    pm = parallelize_rank(src, lay, rank)
                # flattened meshes come from DeviceMesh's bookkeeping, not root slices (deprecated)
                assert not [w for w in caught if "Slicing a flattened dim" in str(w.message)], (name, rank)
                c = lay.coords(rank)
                fsdp_rank = c["dp_shard"] * lay.cp + c["cp"]
                real = {n.removeprefix(prefix): (p.to_local() if hasattr(p, "to_local") else p).numel()
                        for n, p in pm.module.named_parameters()}
                plan = {p.name: local_numel(p, lay, c["tp"], fsdp_rank) for p in owned_params(src.desc, lay, c["pp"])}
                assert real == plan, (name, rank)
                assert sum(real.values()) == rank_param_numel(src.desc, lay, rank)
                for label, dims in GROUP_DIMS.items():
                    if any(getattr(lay, d) > 1 for d in dims):
                        got = submesh(pm.mesh, MESH_NAMES.get(label, dims[0])).mesh.flatten().tolist()
                        assert got == lay.group_ranks(rank, dims), (name, rank, label)
                checked += 1
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()
    assert checked >= 40


def test_layouts_that_do_not_divide_are_refused_with_the_projects_message():
    from common.config import ConfigError
    from common.plan.dry_run import parallelize_rank
    from common.plan.search import check
    src = _tiny_dit_source()
    bad = Layout(dp_shard=2, tp=3)  # 4 heads
    why = check(src.desc, bad)
    assert why and "heads" in why and "\n" not in why
    with pytest.raises(ConfigError, match="heads"):
        parallelize_rank(src, bad, 0)
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    assert "split evenly" in check(src.desc, Layout(pp=3, dp_shard=2, microbatches=3))


# --------------------------------------------------------------------------- measured CPU runs (gloo)
# name: (world size, config overrides, the planner's layout); bench/comm_volume.py's model and
# batch (4 per rank), its layouts plus two pipeline ones at 4 ranks.
COMM_LAYOUTS = {
    "fsdp2-zero3": (2, ["parallel.dp_mode=fsdp", "parallel.reshard_after_forward=true"],
                    Layout(dp_shard=2, micro_batch=4)),
    "tp2": (2, ["parallel.tp=2", "parallel.sequence_parallel=false"],
            Layout(tp=2, dp_mode="none", sequence_parallel=False, micro_batch=4)),
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"], Layout(tp=2, dp_mode="none", micro_batch=4)),
    "cp2-ulysses": (2, ["parallel.cp=2", "parallel.cp_mode=ulysses"], Layout(cp=2, micro_batch=4)),
    "pp2-fsdp2": (4, ["parallel.pp=2", "parallel.dp_mode=fsdp"],
                  Layout(pp=2, dp_shard=2, microbatches=2, micro_batch=4)),
    "pp2-tp2-sp": (4, ["parallel.pp=2", "parallel.tp=2", "parallel.dp_mode=none"],
                   Layout(pp=2, tp=2, dp_mode="none", microbatches=2, micro_batch=4)),
}


def _measure(rank, world, names):
    """One counted training step per layout (the second; bench/comm_volume.py's CommCounter,
    model and batch), after an AdamW step; returns per layout {kind: [calls, buffer bytes]} and the
    local numel of parameters, gradients and AdamW moments."""
    import torch.nn.functional as F
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import comm_volume as cv

    from common.config import build_config
    from common.dist import DistInfo
    from common.nn.dit_parallel import parallelize_dit
    from pipelines.text2image import components
    from pipelines.text2image.config import T2IConfig
    info = DistInfo(rank, world, rank, torch.device("cpu"))
    out = {}
    for name in names:
        _, overrides, lay = COMM_LAYOUTS[name]
        cfg = build_config(T2IConfig, None, cv.MODEL + overrides)
        comp = components.build(cfg)
        pm = parallelize_dit(comp.model, cfg.parallel, info, criterion=F.mse_loss, microbatches=lay.microbatches)
        g = torch.Generator().manual_seed(0)
        b, c, s = cv.BATCH * lay.microbatches, comp.latent_channels, comp.latent_size
        x, target = torch.randn(b, c, s, s, generator=g), torch.randn(b, c, s, s, generator=g)
        t = torch.rand(b, generator=g)
        ctx = torch.randn(b, cfg.text.context_length, cfg.text.width, generator=g)
        mask = torch.ones(b, cfg.text.context_length, dtype=torch.bool)
        opt = torch.optim.AdamW(pm.module.parameters(), lr=1e-3)
        for step in range(2):
            counter = cv._make_counter()
            with counter:
                if pm.pipeline is not None:
                    pm.pipeline.step((x, t, ctx, mask), target)
                else:
                    F.mse_loss(pm.module(x, t, ctx, mask), target).backward()
                for hook in pm.grad_hooks:
                    hook()
            if step == 0:
                opt.step()
                opt.zero_grad(set_to_none=True)
        kinds = {}
        for (kind, _group), (calls, buf, _wire) in counter.records.items():
            k = kinds.setdefault(kind, [0, 0])
            k[0] += calls
            k[1] += buf
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        params = list(pm.module.parameters())
        out[name] = {"kinds": kinds, "params": sum(local(p).numel() for p in params),
                     "grads": sum(local(p.grad).numel() for p in params if p.grad is not None),
                     "adam": sum(local(opt.state[p][k]).numel() for p in params for k in ("exp_avg", "exp_avg_sq"))}
    return out


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_collective_bytes_and_optimizer_state_equal_the_measured_run(world):
    from dist_harness import run_ranks
    src = plan_source.resolve("text2image", None, _bench("comm_volume").MODEL)
    names = [n for n, (w, _, _) in COMM_LAYOUTS.items() if w == world]
    per_rank = run_ranks(_measure, world, (names,), timeout=600)
    for name in names:
        lay = COMM_LAYOUTS[name][2]
        for rank, res in enumerate(per_rank):
            got = res[name]
            planned = {}
            for c in collectives(src.desc, lay, pp_rank=lay.coords(rank)["pp"], elem=4, grad_elem=4):
                p = planned.setdefault(c.kind, [0, 0])
                p[1] += c.buffer
                p[0] += c.calls
            got_bytes = {k: v[1] for k, v in got["kinds"].items()}
            assert got_bytes == pytest.approx({k: v[1] for k, v in planned.items()}, rel=1e-9, abs=0), \
                (name, rank, got["kinds"], planned)
            if lay.pp > 1 or lay.dp_mode == "fsdp":  # call counts are planned for FSDP and PP sends
                for kind in ("all_gather", "reduce_scatter", "send", "recv"):
                    if kind in planned and planned[kind][0]:
                        assert got["kinds"][kind][0] == planned[kind][0], (name, rank, kind)
            n = rank_param_numel(src.desc, lay, rank)
            assert (got["params"], got["grads"], got["adam"]) == (n, n, 2 * n), (name, rank)


def test_saved_activations_within_15_percent_of_the_bench_measurement():
    import argparse
    am = _bench("activation_memory")
    args = argparse.Namespace(hidden=96, depth=4, heads=4, batch=2, img_size=16, patch_size=2, in_channels=4,
                              text_len=8, text_dim=32, every=2, warmup=0, steps=1)
    base = am.build_model(args)
    mc = base.cfg
    desc = dit_desc("bench", hidden=mc.hidden, depth=mc.depth, heads=mc.heads, mlp_ratio=mc.mlp_ratio,
                    text_dim=mc.text_dim, text_len=args.text_len, tokens=mc.num_tokens, patch_in=16, out_dim=16,
                    patch_conv=(4, 2, 2))
    for mode in ("none", "selective", "full"):
        measured = am.bench_mode(base, mode, args, torch.device("cpu"))["saved_bytes"]
        planned = activation_bytes(desc, Layout(micro_batch=args.batch, ac=mode, dp_mode="none"), 0, elem=4)
        # the plan also counts the block being recomputed, which is alive in backward only
        if mode != "none":
            planned -= args.batch * block_activation_elems(desc) * 4
        assert planned == pytest.approx(measured, rel=0.15), (mode, planned, measured)


def test_llama_saved_activations_with_the_loss_within_15_percent():
    import torch.nn.functional as F

    from common.nn.llama import Llama, LlamaConfig
    from common.parallel.activation_checkpoint import SavedTensorMeter
    b, n = 2, 64
    lc = LlamaConfig(dim=96, n_layers=3, n_heads=4, vocab_size=256, ffn_hidden=256, max_seq_len=n)
    model = Llama(lc)
    desc = llama_desc("l", dim=96, n_layers=3, n_heads=4, kv_heads=4, ffn=256, vocab=256, seq_len=n)
    tokens = torch.randint(0, 256, (b, n))
    with SavedTensorMeter(model) as meter:
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    planned = activation_bytes(desc, Layout(micro_batch=b, dp_mode="none"), 0, elem=4)
    assert planned == pytest.approx(meter.device_bytes, rel=0.15)


# --------------------------------------------------------------------------- CLI
def _plan(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "common.plan", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\d+) .*\|\s*([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+"
                 r"([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*\|\s*([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*\|\s*"
                 r"([\d.]+)%\s+(\S+)$")


def test_cli_ranks_layouts_that_fit_and_divide():
    proc = _plan("--model", "llama-7b", "--gpus", "1024", "--top", "6")
    assert proc.returncode == 0, proc.stderr
    rows = [ROW.match(line) for line in proc.stdout.splitlines()]
    rows = [r for r in rows if r]
    assert len(rows) == 6, proc.stdout
    steps = [float(r.group(16)) for r in rows]
    assert steps == sorted(steps)
    for r in rows:
        pp, tp = int(r.group(2)), int(r.group(6))
        assert 32 % pp == 0 and 32 % tp == 0
        parts = [float(r.group(i)) for i in range(7, 12)]
        assert float(r.group(12)) == pytest.approx(sum(parts), abs=0.3)
        assert float(r.group(12)) <= 0.92 * 79.1
        comp, comm, bubble, step = (float(r.group(i)) for i in range(13, 17))
        assert step == pytest.approx(comp + comm + bubble, abs=2e-3)
        assert 0 < float(r.group(17)) < 100


def test_cli_help_and_one_line_errors(capsys):
    from common.cli import run_cli
    from common.plan.__main__ import main
    proc = _plan("--help")  # the real entrypoint once
    assert proc.returncode == 0 and "--dry-run" in proc.stdout and "--nodes-of" in proc.stdout
    proc = _plan("--model", "dit-xl", "--gpus", "64", "--gpu", "tpu")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error:") and "--gpu" in proc.stderr
    dry = ["--model", "dit-xl", "--dry-run", "--layout"]
    for args, needle in ((["--model", "nope", "--gpus", "8"], "--model"),
                         (["--model", "dit-xl", "--gpus", "many"], "--gpus"),
                         (["--model", "dit-xl"], "--gpus"),
                         (["--pipeline", "nope", "--gpus", "8"], "no pipelines/nope"),
                         ([*dry, "tp=3", "--gpus", "1536"], "16 attention heads"),
                         ([*dry, "pp=3", "--gpus", "1536"], "split evenly"),
                         ([*dry, "pp=3", "--gpus", "1024"], "does not divide"),
                         (["--model", "llama-7b", "--gpus", "10240", "--global-batch", "1024"], "divides"),
                         (["--model", "llama-7b", "--gpus", "1", "--global-batch", "1"], "no layout")):
        with pytest.raises(SystemExit) as exit_:
            run_cli(main, args)
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2, (args, err)
        assert len(err.splitlines()) == 1 and err.startswith("error:") and needle in err, (args, err)


@pytest.mark.parametrize("model,gpus,layout", [
    ("llama-7b", 1024, "pp=4,cp=2,tp=8,microbatches=8"),
    ("llama-7b", 10240, "pp=8,cp=2,tp=8,microbatches=8"),
    ("dit-xl", 10240, "pp=4,cp=2,tp=8,microbatches=8,micro_batch=4"),
])
def test_full_size_dry_run(model, gpus, layout):
    t0 = time.time()
    proc = _plan("--model", model, "--gpus", str(gpus), "--dry-run", "--layout", layout, timeout=120)
    wall = time.time() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("(equal to the plan)") == 3 and "PLAN SAYS" not in out and "differs" not in out, out
    tp_groups = re.findall(r"^\s+tp\s+\[([\d, ]+)\]", out, re.M)
    assert len(tp_groups) == 3 and all(len(g.split(",")) == 8 for g in tp_groups)
    pp = int(layout.split(",")[0].removeprefix("pp="))
    fsdp = gpus // (pp * 8)  # dp_shard x cp with tp 8
    assert re.search(rf"fsdp \(dp_shard x cp\)\s+\[.*\] \({fsdp} ranks\)", out)
    assert wall < 60, wall
