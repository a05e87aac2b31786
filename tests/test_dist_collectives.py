"""Host values (losses, counts, times, the gradient norm) are reduced on the device the process
group's backend takes: NCCL refuses CPU tensors, so a CPU tensor handed to a collective would stop
every multi-GPU run at its first step (common/dist.py). The training run that checks every
collective goes through these helpers is in tests/test_pipeline_contract.py."""
from unittest import mock

import pytest

import torch

from common import dist as mdist


def test_collective_device_follows_the_backend():
    with mock.patch.object(torch.distributed, "get_backend", return_value="nccl"), \
            mock.patch.object(torch.cuda, "current_device", return_value=3):
        assert mdist.collective_device() == torch.device("cuda", 3)
    with mock.patch.object(torch.distributed, "get_backend", return_value="gloo"):
        assert mdist.collective_device() == torch.device("cpu")


def test_without_other_ranks_the_values_come_back():
    assert not mdist.distributed()
    assert mdist.all_reduce_floats([1.5, 2], op="max") == [1.5, 2.0]
    assert mdist.all_gather_floats(4) == [4.0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU check runs it)")
def test_nccl_refuses_a_cpu_tensor_and_takes_one_on_the_collective_device():
    """The premise on the real stack, with a one-rank NCCL group (bench/gpu_check.sh, step tests)."""
    import torch.distributed as dist
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        with pytest.raises(RuntimeError):
            dist.all_reduce(torch.ones(1, dtype=torch.float64))
        assert mdist.collective_device() == device
        t = torch.full((2,), 1.5, dtype=torch.float64, device=mdist.collective_device())
        dist.all_reduce(t)
        assert t.tolist() == [1.5, 1.5]
    finally:
        dist.destroy_process_group()
