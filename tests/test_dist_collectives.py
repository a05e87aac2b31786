"""Host values (losses, counts, times, the gradient norm) are reduced on the device the process
group's backend takes: NCCL refuses CPU tensors, so a CPU tensor handed to a collective would stop
every multi-GPU run at its first step (common/dist.py). The training run that checks every
collective goes through these helpers is in tests/test_pipeline_contract.py."""
from unittest import mock

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
