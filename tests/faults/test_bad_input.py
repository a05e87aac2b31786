"""Bad configuration and input: each is exactly one line on stderr naming the problem, no
traceback, exit code 2. Run in-process through the CLI wrapper (common.cli.run_cli, what
`python -m pipelines.text2image.train` runs) for speed; a few as real subprocesses too."""
from __future__ import annotations

import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.conftest import ROOT, SMALL_MODEL, TINY_YAML, env

from .conftest import REF_STEPS


@pytest.fixture(scope="module")
def bad(tmp_path_factory, synth_data):
    """Paths of broken inputs."""
    d = tmp_path_factory.mktemp("bad")
    (d / "empty_dir").mkdir()
    (d / "empty_tar").mkdir()
    import tarfile
    tarfile.open(d / "empty_tar" / "shard-000000.tar", "w").close()  # a valid tar without samples
    (d / "garbage_tar").mkdir()
    (d / "garbage_tar" / "shard-000000.tar").write_bytes(bytes(random.Random(0).randrange(256) for _ in range(5000)))
    (d / "bad_yaml").write_text("train:\n  steps: [1, 2\n")
    (d / "section_yaml").write_text("trainer:\n  steps: 3\n")
    (d / "list_yaml").write_text("- 1\n- 2\n")
    (d / "config_dir").mkdir()
    return {k: str(d / k) for k in ("empty_dir", "empty_tar", "garbage_tar", "bad_yaml", "section_yaml", "list_yaml",
                                   "config_dir")}


# (id, overrides (may use {bad paths}, {ref}: a checkpoint of another model), words the line must hold)
CASES = [
    ("unknown_key", ["trian.steps=3"], ["'trian.steps=3'", "unknown config key 'trian'", "train.steps"]),
    ("unknown_nested_key", ["model.hiden=32"], ["unknown config key 'model.hiden'", "model.hidden"]),
    ("wrong_type_int", ["train.steps=abc"], ["train.steps", "abc"]),
    ("wrong_type_bool", ["train.progress=maybe"], ["train.progress", "maybe"]),
    ("wrong_type_float", ["optim.lr=fast"], ["optim.lr", "fast"]),
    ("negative_steps", ["train.steps=-1"], ["train.steps=-1", "> 0"]),
    ("zero_micro_batch", ["data.micro_batch_size=0"], ["data.micro_batch_size=0", "> 0"]),
    ("negative_workers", ["data.num_workers=-1"], ["data.num_workers=-1", ">= 0"]),
    ("zero_grad_accum", ["train.grad_accum=0"], ["train.grad_accum=0"]),
    ("bad_choice", ["optim.schedule=linear"], ["optim.schedule", "linear", "cosine"]),
    ("two_low_precision_recipes", ["precision.fp8=tensorwise", "precision.int8=true"], ["fp8", "int8"]),
    ("ckpt_every_word", ["train.ckpt_every=often"], ["train.ckpt_every", "auto"]),
    ("heads_indivisible", ["model.heads=3"], ["heads"]),
    ("patch_indivisible", ["model.patch_size=5"], ["patch_size"]),
    ("layout_needs_more_ranks", ["parallel.tp=2"], ["parallel", "world size"]),
    ("missing_shards", ["data.train_shards=/nonexistent/shards"], ["/nonexistent/shards", "does not exist"]),
    ("shard_pattern_matches_nothing", ["data.train_shards={empty_dir}/x-{{000..003}}.tar"],
     ["{empty_dir}/x-{{000..003}}.tar", "matches no files"]),
    ("empty_shard_dir", ["data.train_shards={empty_dir}"], ["{empty_dir}", "no .tar files"]),
    ("empty_shards", ["data.train_shards={empty_tar}"], ["dataset is empty"]),
    ("not_a_tar", ["data.train_shards={garbage_tar}"], ["not a valid tar"]),
    ("checkpoint_of_another_model", ["model.hidden=64", "run.resume={ref}"], ["another model", "hidden"]),
    ("missing_checkpoint", ["run.resume=/nonexistent/ckpt"], ["checkpoint not found: /nonexistent/ckpt"]),
    ("seed_negative", ["run.seed=-1"], ["run.seed=-1"]),
    ("seed_too_large", [f"run.seed={2**63}"], ["run.seed="]),
    ("straggler_factor", ["train.straggler_factor=1.0"], ["train.straggler_factor", "> 1"]),
    ("cpu_offload_without_fsdp", ["parallel.cpu_offload=true"], ["parallel.cpu_offload"]),
    ("zero2_without_fsdp", ["parallel.reshard_after_forward=false"], ["parallel.reshard_after_forward", "FSDP"]),
]
CONFIG_CASES = [  # --config FILE problems
    ("config_missing", "/nonexistent/train.yaml", ["/nonexistent/train.yaml"]),
    ("config_bad_yaml", "{bad_yaml}", ["{bad_yaml}"]),
    ("config_unknown_section", "{section_yaml}", ["trainer"]),
    ("config_not_a_mapping", "{list_yaml}", ["{list_yaml}"]),
    ("config_is_a_directory", "{config_dir}", ["{config_dir}"]),
]


@pytest.fixture
def fresh_globals():
    """train() seeds the global RNGs and turns deterministic algorithms on: put them back."""
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    det = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])
    torch.use_deterministic_algorithms(det[0], warn_only=det[1])


def fill(items, paths):
    return [s.format(**paths) for s in items]


def argv_for(run_dir, data_dir, overrides, config=TINY_YAML):
    # train.steps=1: a case that is wrongly accepted ends after one quick step instead of training.
    return ["--config", config, f"run.dir={run_dir}", f"data.train_shards={data_dir}/train",
            f"data.eval_shards={data_dir}/heldout", *SMALL_MODEL, "train.steps=1", "sample.num=0",
            "train.sample_every=0", *overrides]


def in_process(argv, capsys) -> tuple[int, str]:
    from common.cli import run_cli
    from common.run import train
    from pipelines.text2image.spec import SPEC
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda a: train(SPEC, a), argv)
    return exit_info.value.code, capsys.readouterr().err


def check_one_line(code, err, words):
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, err)
    assert lines[0].startswith("error: "), lines
    for w in words:
        assert w in lines[0], (w, lines[0])
    if os.environ.get("MMP_SHOW_ERRORS"):
        with open(os.environ["MMP_SHOW_ERRORS"], "a") as f:
            f.write(lines[0] + "\n")


@pytest.fixture(scope="module")
def paths(bad, ref_single):
    return {**bad, "ref": os.path.join(ref_single, "checkpoints", f"step_{REF_STEPS:08d}")}


@pytest.mark.parametrize("name,overrides,words", [pytest.param(*c, id=c[0]) for c in CASES])
def test_bad_setting_is_one_line(name, overrides, words, paths, synth_data, tmp_path, capsys, fresh_globals):
    code, err = in_process(argv_for(str(tmp_path / "run"), synth_data, fill(overrides, paths)), capsys)
    check_one_line(code, err, fill(words, paths))


@pytest.mark.parametrize("name,config,words", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_file_is_one_line(name, config, words, paths, synth_data, tmp_path, capsys, fresh_globals):
    code, err = in_process(argv_for(str(tmp_path / "run"), synth_data, [], config=config.format(**paths)), capsys)
    check_one_line(code, err, fill(words, paths))


def test_run_dir_of_another_model_is_one_line(ref_single, synth_data, tmp_path, capsys, fresh_globals):
    """Relaunching into a run directory whose checkpoints belong to another model (run.resume
    left at auto) stops before anything in it is replaced."""
    import shutil
    run = tmp_path / "run"
    shutil.copytree(os.path.join(ref_single, "checkpoints"), run / "checkpoints")
    before = sorted(os.listdir(run / "checkpoints"))
    code, err = in_process(argv_for(str(run), synth_data, ["model.depth=3", f"train.steps={REF_STEPS + 1}"]), capsys)
    check_one_line(code, err, ["another model", "depth"])
    assert sorted(os.listdir(run / "checkpoints")) == before and not (run / "config.yaml").exists()


def test_unknown_command_line_option_is_one_line(synth_data, tmp_path, capsys, fresh_globals):
    code, err = in_process(argv_for(str(tmp_path / "run"), synth_data, ["--stpes=3"]), capsys)
    check_one_line(code, err, ["--stpes=3"])


@pytest.mark.parametrize("name", ["unknown_key", "missing_shards", "config_bad_yaml"])
def test_as_a_real_subprocess(name, paths, synth_data, tmp_path):
    """The same through `python -m pipelines.text2image.train`: stderr is exactly the one line."""
    case = {c[0]: c for c in CASES + CONFIG_CASES}[name]
    if name.startswith("config_"):
        argv, words = argv_for(str(tmp_path / "run"), synth_data, [], config=case[1].format(**paths)), case[2]
    else:
        argv, words = argv_for(str(tmp_path / "run"), synth_data, fill(case[1], paths)), case[2]
    proc = subprocess.run([sys.executable, "-m", "pipelines.text2image.train", *argv], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300)
    check_one_line(proc.returncode, proc.stderr, fill(words, paths))
