"""torch.distributed set-up and the device / dtype policy.

The same entrypoint runs under plain `python` (world size 1, no process group) and under
`torchrun` (gloo on CPU, nccl on CUDA). The dtypes come from one PrecisionPolicy
(common/precision/policy.py): by default fp32 on CPU, whose cores have no bf16 units (bf16 ~75x
slower), and bf16 compute with fp32 master weights and fp32 reduction on CUDA, in every layout.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch
import torch.distributed as dist

from common.config import ConfigError
from common.precision.policy import PrecisionPolicy, default_policy, resolve_policy


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    precision: PrecisionPolicy = PrecisionPolicy()

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.precision.compute_dtype

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


# Variables that change how collectives behave (transport, interfaces, timeouts, debug output):
# printed at start so a slow or hanging job's log says which settings it ran with.
COMM_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_")


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher (torchrun, or a Slurm script around it) told this process."""
    world_size: int
    rank: int
    local_rank: int
    local_world_size: int
    master: str | None  # MASTER_ADDR:MASTER_PORT, None without a launcher
    restart_count: int  # TORCHELASTIC_RESTART_COUNT: how many times torchrun restarted the workers
    max_restarts: int | None
    comm_env: tuple[tuple[str, str], ...]

    @property
    def launched(self) -> bool:
        return self.master is not None or self.world_size > 1

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_world_size

    def describe(self, backend: str) -> str:
        restarts = f"torchrun restart {self.restart_count}" + (
            f" of max {self.max_restarts}" if self.max_restarts is not None else "")
        comm = " ".join(f"{k}={v}" for k, v in self.comm_env) or "none set"
        nodes = f"{self.nodes} node{'s' * (self.nodes != 1)}"
        return (f"launch: world size {self.world_size} = {nodes} x {self.local_world_size} per node, "
                f"backend {backend}, master {self.master or '-'}, {restarts}, NCCL/GLOO env: {comm}")


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"launcher environment: {name}={raw!r} is not an integer") from None


def launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """The launcher's variables, checked for consistency (ConfigError, one line) before any
    process group is formed: a wrong value there shows up as a hang, not as an error."""
    e = os.environ if environ is None else environ
    world_size = _env_int(e, "WORLD_SIZE", 1)
    rank = _env_int(e, "RANK", 0)
    local_rank = _env_int(e, "LOCAL_RANK", 0)
    # Without torchrun (WORLD_SIZE set by hand), assume every process is on this node.
    local_world_size = _env_int(e, "LOCAL_WORLD_SIZE", world_size)
    max_restarts = e.get("TORCHELASTIC_MAX_RESTARTS")
    env = LaunchEnv(
        world_size=world_size, rank=rank, local_rank=local_rank, local_world_size=local_world_size,
        master=f"{e['MASTER_ADDR']}:{e.get('MASTER_PORT', '?')}" if e.get("MASTER_ADDR") else None,
        restart_count=_env_int(e, "TORCHELASTIC_RESTART_COUNT", 0),
        max_restarts=int(max_restarts) if max_restarts and max_restarts.lstrip("-").isdigit() else None,
        comm_env=tuple(sorted((k, v) for k, v in e.items() if k.startswith(COMM_ENV_PREFIXES))))
    if world_size < 1 or local_world_size < 1:
        raise ConfigError(f"launcher environment: WORLD_SIZE={world_size} and LOCAL_WORLD_SIZE={local_world_size} "
                          "must be >= 1")
    if not 0 <= rank < world_size:
        raise ConfigError(f"launcher environment: RANK={rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={world_size})")
    if not 0 <= local_rank < local_world_size:
        raise ConfigError(f"launcher environment: LOCAL_RANK={local_rank} is outside 0..LOCAL_WORLD_SIZE-1 "
                          f"(LOCAL_WORLD_SIZE={local_world_size})")
    if world_size % local_world_size:
        raise ConfigError(f"launcher environment: LOCAL_WORLD_SIZE={local_world_size} does not divide "
                          f"WORLD_SIZE={world_size}: every node must run the same number of processes "
                          "(torchrun --nproc-per-node is the same on all nodes)")
    if world_size > 1 and not (e.get("MASTER_ADDR") and e.get("MASTER_PORT")):
        raise ConfigError(f"launcher environment: WORLD_SIZE={world_size} but MASTER_ADDR/MASTER_PORT are not set; "
                          "launch with torchrun (or launch/slurm.sh)")
    return env


def check_devices(env: LaunchEnv, use_cuda: bool, cuda_devices: int) -> None:
    """One process per GPU: more local processes than visible GPUs would put two ranks on one."""
    if use_cuda and env.local_world_size > cuda_devices:
        raise ConfigError(f"launcher environment: {env.local_world_size} processes per node (LOCAL_WORLD_SIZE) "
                          f"but {cuda_devices} CUDA devices visible (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); lower --nproc-per-node")


def _per_attempt_store(env: LaunchEnv):
    """torchrun's workers share its rendezvous TCPStore (TORCHELASTIC_USE_AGENT_STORE), which
    outlives a restart, and the process group's keys carry no attempt number: a restarted gloo
    group can read the dead attempt's addresses and fail ("Connection refused"; 2 in 3 restarts
    here). A prefix per torchrun restart keeps the attempts apart. None: use env:// as usual."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from datetime import timedelta
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size,
                          is_master=False, timeout=timedelta(minutes=10))
    return dist.PrefixStore(f"attempt_{env.restart_count}", store)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group_on(device: torch.device, **kwargs) -> None:
    """init_process_group with the backend of `device` (backend_for); an NCCL group is bound to
    that GPU (device_id). Without the binding NCCL guesses the GPU from the global rank ("can
    cause a hang if rank to GPU mapping is heterogeneous") and barrier() warns that it picks the
    current device; both seen in the first H200 run."""
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(backend=backend_for(device), **kwargs)


def init_distributed(device: str = "auto", precision=None) -> DistInfo:
    """Initialise the process group when launched by torchrun; idempotent. precision: a
    PrecisionConfig (None: the device's default policy). Rank 0 prints one line of launcher
    facts (world size, nodes, backend, master, restart count, NCCL/GLOO settings)."""
    env = launch_env()
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda:
        check_devices(env, use_cuda, torch.cuda.device_count())
        torch.cuda.set_device(env.local_rank)
        dev = torch.device("cuda", env.local_rank)
    else:
        dev = torch.device("cpu")
    if env.world_size > 1 and not dist.is_initialized():
        store = _per_attempt_store(env)
        init_process_group_on(dev, **({} if store is None else
                                      dict(store=store, rank=env.rank, world_size=env.world_size)))
    if env.launched and env.rank == 0:
        print(env.describe(backend_for(dev) if env.world_size > 1 else "none"), flush=True)
    policy = default_policy(dev) if precision is None else resolve_policy(precision, dev)
    return DistInfo(env.rank, env.world_size, env.local_rank, dev, policy)


def distributed(group=None) -> bool:
    """Whether a collective over `group` (default: the world) has other ranks to reach."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def collective_device(group=None) -> torch.device:
    """Where a host value (a loss, a count, a time) must sit to be reduced over `group`. NCCL takes
    CUDA tensors only and refuses a CPU one ("No backend type associated with device type cpu"),
    so under NCCL it is this process's GPU; gloo and the other CPU backends take CPU tensors."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_tensor(t: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """t reduced (sum or max) over `group`, on collective_device (moved there when it is not,
    e.g. a CPU value under NCCL); t itself without other ranks."""
    if not distributed(group):
        return t
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
    t = t.to(collective_device(group))
    dist.all_reduce(t, op=ops[op], group=group)
    return t


def all_reduce_floats(values, op: str = "sum", group=None) -> list[float]:
    """Host floats reduced over `group` in one float64 collective (all_reduce_tensor)."""
    if not distributed(group):
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=collective_device(group))
    return all_reduce_tensor(t, op, group).tolist()


def all_gather_floats(value: float, group=None) -> list[float]:
    """Every rank's `value` (float64), in rank order of `group`."""
    if not distributed(group):
        return [float(value)]
    mine = torch.tensor([float(value)], dtype=torch.float64, device=collective_device(group))
    out = torch.empty(dist.get_world_size(group), dtype=torch.float64, device=mine.device)
    dist.all_gather_into_tensor(out, mine, group=group)
    return out.tolist()


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def seed_everything(seed: int, rank: int = 0) -> None:
    """Per-rank seeds for anything that draws from global RNGs. Training noise does not: it is
    seeded per sample from global positions so parallel layouts draw identical noise."""
    s = seed + 1000003 * rank
    random.seed(s)
    np.random.seed(s % (2**32))
    torch.manual_seed(s)


RNG_FORMAT = 1


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    """This process's global RNG states as (tensors, JSON-able dict), so that a checkpoint stores
    them without pickle and loads them with torch.load(weights_only=True): torch's CPU and CUDA
    generator states are uint8 tensors; Python's Mersenne Twister and numpy's legacy state are
    integers (and a cached float, exact through JSON's shortest round-trip repr)."""
    legacy = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        legacy["cuda"] = torch.cuda.get_rng_state_all()
    return rng_state_from_legacy(legacy)


def rng_state_from_legacy(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """The (tensors, JSON) form of the dict that checkpoints pickled before (python, numpy,
    torch and optionally cuda states)."""
    version, mt, gauss_next = state["python"]
    bit_generator, key, pos, has_gauss, cached = state["numpy"]
    tensors = {"torch": state["torch"].clone()}
    for i, s in enumerate(state.get("cuda", [])):
        tensors[f"cuda{i}"] = s.clone()
    info = {"format": RNG_FORMAT, "cuda_devices": len(state.get("cuda", [])),
            "python": {"version": int(version), "state": [int(x) for x in mt], "gauss_next": gauss_next},
            "numpy": {"bit_generator": str(bit_generator), "key": [int(x) for x in key], "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    return tensors, info


def set_rng_state(tensors: dict[str, torch.Tensor], info: dict) -> None:
    """Inverse of rng_state(). CUDA states are restored for the devices both runs have."""
    if info.get("format") != RNG_FORMAT:
        raise ValueError(f"RNG state format {info.get('format')!r} is not supported (expected {RNG_FORMAT})")
    py, npy = info["python"], info["numpy"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    np.random.set_state((npy["bit_generator"], np.asarray(npy["key"], dtype=np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(tensors["torch"])
    if torch.cuda.is_available():
        for i in range(min(int(info.get("cuda_devices", 0)), torch.cuda.device_count())):
            torch.cuda.set_rng_state(tensors[f"cuda{i}"], i)
