"""How a tensor-parallel group is wired for a device, checked without one: the process
group's backend (host collectives must work on CUDA too), each rank's device from the
configured base device, and the refusals made before any process starts."""

from __future__ import annotations

import pytest

from pyengine.config import EngineConfig
from pyengine.errors import InvalidConfigError
from pyengine.executor.tensor_parallel.rendezvous import Rendezvous, backend_for, from_environment
from pyengine.executor.tensor_parallel.runner import check_devices


def test_cuda_groups_carry_host_tensors_over_gloo_and_device_tensors_over_nccl():
    assert backend_for("cpu") == "gloo"
    for device in ("cuda", "cuda:0", "cuda:3"):
        assert backend_for(device) == "cpu:gloo,cuda:nccl"
    environ = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "RANK": "1", "WORLD_SIZE": "2"}
    assert from_environment(environ, "cuda").backend == "cpu:gloo,cuda:nccl"
    assert from_environment(environ, "cpu").backend == "gloo"


def test_each_rank_takes_the_device_after_the_configured_one():
    def device_of(local_rank: int, device: str) -> str:
        return Rendezvous("127.0.0.1", 1, local_rank, 4, local_rank, backend_for(device)).device(device)

    assert [device_of(r, "cuda") for r in range(2)] == ["cuda:0", "cuda:1"]
    assert [device_of(r, "cuda:1") for r in range(2)] == ["cuda:1", "cuda:2"]
    assert device_of(1, "cpu") == "cpu"


def test_too_few_devices_are_refused_before_any_process():
    check_devices("cuda:1", 2, count=3)
    check_devices("cpu", 8, count=0)
    with pytest.raises(InvalidConfigError, match="devices 1..2.*2 CUDA device"):
        check_devices("cuda:1", 2, count=2)
    with pytest.raises(InvalidConfigError, match="devices 0..3"):
        check_devices("cuda", 4, count=1)


def test_data_parallel_with_tensor_parallel_on_cuda_is_refused():
    with pytest.raises(InvalidConfigError, match="data_parallel_size"):
        EngineConfig(device="cuda", data_parallel_size=2, tensor_parallel_size=2)
    EngineConfig(device="cpu", data_parallel_size=2, tensor_parallel_size=2)
    EngineConfig(device="cuda", data_parallel_size=2)
