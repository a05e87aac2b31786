"""Launch recipes (README "Scaling out", launch/slurm.sh) and the launcher checks at start-up.

- Multi-node torchrun: two torchrun "nodes" of 2 processes each meet at a c10d rendezvous on
  loopback and train FSDP over the 4 ranks; losses, grad norms and final weights equal the
  single-process run (the parallel-grid rule: rtol 1e-5).
- launch/slurm.sh runs under a fake `srun`/`scontrol` that record their command lines and run the
  job on this machine (2 "nodes" x 1 process); the torchrun arguments must be what the Slurm
  environment implies, and the job must train like the single process.
- The launcher environment is checked before a process group forms (a wrong value there hangs
  rather than fails): one-line errors, and rank 0 prints the launcher facts.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys

import pytest
import torch

from common.config import ConfigError
from common.dist import check_devices, launch_env
from tests.conftest import (ROOT, SMALL_MODEL, TINY_YAML, assert_same_training, env, run_train, shared_once,
                            wait_until)
from tests.conftest import final_weights as conftest_final_weights

STEPS = 3
GLOBAL_BATCH = 8
COMMON = [f"train.steps={STEPS}", "train.log_every=1", "train.ckpt_every=100", "train.sample_every=0",
          "sample.num=0", "train.ema_decay=0"]
MODULE = "pipelines.text2image.train"
SLURM_SH = os.path.join(ROOT, "launch", "slurm.sh")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_args(run_dir: str, data_dir: str, *overrides: str) -> list[str]:
    return ["--config", TINY_YAML, f"run.dir={run_dir}", f"data.train_shards={data_dir}/train",
            f"data.eval_shards={data_dir}/heldout", *SMALL_MODEL, *COMMON, *overrides]


def wait_all(procs: list[subprocess.Popen], timeout: int = 300) -> list[tuple[int, str]]:
    """(returncode, stdout + stderr) of each process; all are killed if one overruns."""
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, out + err) for p, (out, err) in zip(procs, outs)]


def assert_same_weights(ref_run: str, run: str) -> None:
    from pipelines.text2image.spec import SPEC
    ref_w, par_w = conftest_final_weights(SPEC, ref_run, STEPS), conftest_final_weights(SPEC, run, STEPS)
    assert ref_w.keys() == par_w.keys()
    for name in ref_w:
        torch.testing.assert_close(par_w[name], ref_w[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def single_run(synth_data, tmp_path_factory):
    return shared_once(tmp_path_factory, "launch-single", lambda run: run_train(
        run, synth_data, *COMMON, f"data.micro_batch_size={GLOBAL_BATCH}"))


# --------------------------------------------------------------------------- start-up checks
TORCHRUN_ENV = {"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                "MASTER_ADDR": "node01", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "1",
                "TORCHELASTIC_MAX_RESTARTS": "3", "NCCL_DEBUG": "INFO", "GLOO_SOCKET_IFNAME": "lo",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "PATH": "/usr/bin", "NCCLX_UNRELATED": "x"}


def test_startup_line_names_the_launcher_facts():
    line = launch_env(TORCHRUN_ENV).describe("nccl")
    assert line.startswith("launch: world size 8 = 2 nodes x 4 per node, backend nccl, master node01:29500, "
                           "torchrun restart 1 of max 3, ")
    assert "GLOO_SOCKET_IFNAME=lo NCCL_DEBUG=INFO TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in line
    assert "PATH" not in line and "NCCLX" not in line
    plain = launch_env({})  # plain `python`: nothing launched, nothing printed
    assert (plain.world_size, plain.nodes, plain.launched) == (1, 1, False)


@pytest.mark.parametrize("change, message", [
    ({"LOCAL_WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE=3 does not divide WORLD_SIZE=8"),
    ({"RANK": "8"}, "RANK=8 is outside 0..WORLD_SIZE-1 (WORLD_SIZE=8)"),
    ({"LOCAL_RANK": "4"}, "LOCAL_RANK=4 is outside 0..LOCAL_WORLD_SIZE-1 (LOCAL_WORLD_SIZE=4)"),
    ({"WORLD_SIZE": "eight"}, "WORLD_SIZE='eight' is not an integer"),
    ({"MASTER_ADDR": ""}, "WORLD_SIZE=8 but MASTER_ADDR/MASTER_PORT are not set"),
])
def test_inconsistent_launcher_env_is_one_line_error(change, message):
    with pytest.raises(ConfigError) as e:
        launch_env({**TORCHRUN_ENV, **change})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_more_local_ranks_than_gpus_is_refused():
    env4 = launch_env(TORCHRUN_ENV)
    with pytest.raises(ConfigError, match="4 processes per node .* but 2 CUDA devices visible"):
        check_devices(env4, use_cuda=True, cuda_devices=2)
    check_devices(env4, use_cuda=True, cuda_devices=4)
    check_devices(env4, use_cuda=False, cuda_devices=0)  # CPU ranks share the host


def test_nccl_group_is_bound_to_the_local_gpu(monkeypatch):
    """On CUDA the group gets device_id = cuda:LOCAL_RANK (NCCL otherwise guesses the GPU from the
    global rank); gloo gets none. The CUDA calls are stubbed: only the arguments are checked."""
    import common.dist as cd
    calls = []
    monkeypatch.setattr(cd.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(cd.dist, "init_process_group", lambda **kw: calls.append(kw))
    monkeypatch.setattr(cd, "default_policy", lambda dev: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    for k, v in {**TORCHRUN_ENV, "RANK": "6", "LOCAL_RANK": "2"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    info = cd.init_distributed(device="cuda")
    assert calls == [{"backend": "nccl", "device_id": torch.device("cuda", 2)}] and info.device == calls[0]["device_id"]
    calls.clear()
    cd.init_distributed(device="cpu")
    assert calls == [{"backend": "gloo"}]


def test_entrypoint_refuses_bad_launcher_env_before_any_collective(synth_data, tmp_path):
    bad = {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, "-m", MODULE, *train_args(str(tmp_path / "run"), synth_data)],
                          cwd=ROOT, env={**env(), **bad}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: launcher environment: LOCAL_WORLD_SIZE=3 does not divide WORLD_SIZE=4: every node must run "
        "the same number of processes (torchrun --nproc-per-node is the same on all nodes)")
    assert "Traceback" not in proc.stderr


def test_slurm_script_outside_an_allocation_says_so():
    clean = {k: v for k, v in env().items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", SLURM_SH, MODULE], env=clean, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and "not inside a Slurm allocation" in proc.stderr
    proc = subprocess.run(["bash", SLURM_SH], env=clean, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage: sbatch" in proc.stderr


# --------------------------------------------------------------------------- multi-node torchrun
@pytest.mark.slow
@pytest.mark.dist
def test_two_torchrun_nodes_with_c10d_rendezvous_match_single_process(single_run, synth_data, tmp_path):
    run, port = str(tmp_path / "run"), free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=launch-test-{port}",
                "-m", MODULE, *train_args(run, synth_data, "data.micro_batch_size=2", "parallel.dp_mode=fsdp")]
    nodes = [subprocess.Popen(torchrun, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    results = wait_all(nodes)
    for rc, out in results:
        assert rc == 0, out[-5000:]
    logs = "".join(out for _, out in results)
    assert logs.count("launch: world size 4 = 2 nodes x 2 per node, backend gloo, master ") == 1, logs[-3000:]
    assert "world size 4 [dp_shard=4 (dp_mode=fsdp)]" in logs
    assert_same_training(single_run, run, range(1, STEPS + 1))
    assert_same_weights(single_run, run)


# --------------------------------------------------------------------------- Slurm
FAKE_SRUN = """#!{python}
# Fake srun: records its command line, then runs one copy of the command per task on this machine
# (their pids in tasks.pids, for the fake scancel).
import json, os, subprocess, sys
args = sys.argv[1:]
with open(os.path.join(os.environ["FAKE_SLURM_LOG"], "srun.json"), "w") as f:
    json.dump(args, f)
opts = {{}}
while args and args[0].startswith("-"):
    key, _, value = args.pop(0).lstrip("-").partition("=")
    opts[key] = value
tasks = int(opts["nodes"]) * int(opts["ntasks-per-node"])
procs = [subprocess.Popen(args, env=dict(os.environ, SLURM_PROCID=str(i), SLURM_NODEID=str(i))) for i in range(tasks)]
with open(os.path.join(os.environ["FAKE_SLURM_LOG"], "tasks.pids"), "w") as f:
    f.write(" ".join(str(p.pid) for p in procs))
sys.exit(max(abs(p.wait()) for p in procs))
"""

FAKE_SCONTROL = """#!/bin/bash
# Fake scontrol: records its command line; `show hostnames a,b` prints one host a line.
echo "$@" >> "$FAKE_SLURM_LOG/scontrol.txt"
if [ "$1 $2" = "show hostnames" ]; then tr ',' '\\n' <<< "$3"; fi
"""

FAKE_SCANCEL = """#!/bin/bash
# Fake scancel: records its command line; --signal=TERM signals the fake srun's tasks (job steps).
echo "$@" >> "$FAKE_SLURM_LOG/scancel.txt"
if [ "$1" = "--signal=TERM" ]; then kill -TERM $(cat "$FAKE_SLURM_LOG/tasks.pids"); fi
"""


def fake_slurm(tmp_path) -> tuple[dict, object]:
    """The environment that puts the fake srun and scontrol first on PATH, and their log folder."""
    bin_dir, log_dir = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN.format(python=sys.executable)), ("scontrol", FAKE_SCONTROL),
                       ("scancel", FAKE_SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    return ({"MASTER_PORT": str(free_port()), "MAX_RESTARTS": "0", "PYTHON": sys.executable,
             "FAKE_SLURM_LOG": str(log_dir), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}, log_dir)


@pytest.mark.slow
@pytest.mark.dist
def test_slurm_script_runs_one_torchrun_per_node_rendezvous_on_first_node(single_run, synth_data, tmp_path):
    run = str(tmp_path / "run")
    fake, log_dir = fake_slurm(tmp_path)
    port = fake["MASTER_PORT"]
    # What Slurm sets for `sbatch --nodes=2 --gpus-per-node=1 --cpus-per-task=1`; the first node is
    # this machine (the rendezvous host), the second a name only the fake knows.
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "localhost,node-b",
             "SLURM_GPUS_ON_NODE": "1", "SLURM_CPUS_PER_TASK": "1", **fake}
    user_args = train_args(run, synth_data, "data.micro_batch_size=4", "parallel.dp_mode=fsdp")
    proc = subprocess.run(["bash", SLURM_SH, MODULE, *user_args], cwd=ROOT, env={**env(), **slurm},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]

    assert (log_dir / "scontrol.txt").read_text().split() == ["show", "hostnames", "localhost,node-b"]
    srun = json.loads((log_dir / "srun.json").read_text())
    torchrun_at = srun.index(sys.executable)
    assert srun[:torchrun_at] == ["--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--cpus-per-task=1",
                                  "bash", "-c", 'trap "" USR1; exec "$@"', "torchrun"]  # torchrun survives SIGUSR1
    assert srun[torchrun_at:] == [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                                  "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=4242",
                                  "--max-restarts=0", "-m", MODULE, *user_args]
    assert "launch: world size 2 = 2 nodes x 1 per node, backend gloo" in proc.stdout, proc.stdout[-3000:]
    assert_same_training(single_run, run, range(1, STEPS + 1))
    assert_same_weights(single_run, run)


def _metrics(run: str) -> list[dict]:
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


@pytest.mark.slow
@pytest.mark.dist
def test_slurm_script_on_usr1_saves_requeues_and_the_requeued_job_resumes(synth_data, tmp_path):
    """`sbatch --signal=B:USR1@T`: the signal reaches the batch script alone. It sends the job step
    SIGTERM (scancel; torchrun passes it to the ranks, which save the step in flight), requeues the
    job, and the script's next run (what Slurm starts for the requeued job) resumes and finishes."""
    run, steps = str(tmp_path / "run"), 40
    fake, log_dir = fake_slurm(tmp_path)
    slurm = {"SLURM_JOB_ID": "4243", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "localhost",
             "NPROC_PER_NODE": "2", "SLURM_CPUS_PER_TASK": "2", **fake}
    cmd = ["bash", SLURM_SH, MODULE, *train_args(run, synth_data, f"train.steps={steps}", "data.micro_batch_size=4")]
    slowed = {"MMP_FAULT_SLOW_RANK": "0", "MMP_FAULT_SLOW_S": "0.2"}  # the signal lands mid-run
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**env(), **slurm, **slowed}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_until(proc, lambda: any("loss" in r for r in _metrics(run)))
        os.kill(proc.pid, signal.SIGUSR1)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    logs = out + err
    assert "slurm.sh: SIGUSR1 to the batch script: stopping the step" in out, logs[-5000:]
    assert "slurm.sh: job 4243 requeued" in out, logs[-5000:]
    assert (log_dir / "scancel.txt").read_text().split() == ["--signal=TERM", "4243"]
    assert (log_dir / "scontrol.txt").read_text().splitlines()[-1] == "requeue 4243"
    stopped = [r["step"] for r in _metrics(run) if r.get("event") == "stopped"]
    assert len(stopped) == 1 and 1 <= stopped[0] < steps, logs[-5000:]
    assert open(os.path.join(run, "checkpoints", "latest")).read().strip() == f"step_{stopped[0]:08d}"
    proc = subprocess.run(cmd, cwd=ROOT, env={**env(), **slurm}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert [r["step"] for r in _metrics(run) if r.get("event") == "resume"] == stopped
    assert open(os.path.join(run, "checkpoints", "latest")).read().strip() == f"step_{steps:08d}"
