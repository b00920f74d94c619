"""release_openmp_workers frees the calling thread's OpenMP team, which comes back on demand."""

from __future__ import annotations

import os

import pytest
import torch

from pyengine import _kernels
from pyengine.testing.waits import wait_until


def _thread_ids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _wait_until(condition, seconds: float = 5.0) -> bool:
    return wait_until(condition, seconds, interval=0.01)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc")
def test_release_frees_the_calling_threads_workers_and_they_come_back():
    if torch.get_num_threads() < 2:
        pytest.skip("PyTorch runs one intra-op thread here: no workers to free")
    if not _kernels.release_openmp_workers():  # start without a team on this thread
        pytest.skip("libgomp is not loaded or has no omp_pause_resource_all")
    before = _thread_ids()
    values = torch.arange(4_000_000, dtype=torch.float64)
    expected = float(values.sum())  # parallel regions: this thread gets a team
    workers = _thread_ids() - before
    assert workers, "the parallel region started no worker thread"
    assert _kernels.release_openmp_workers()
    assert _wait_until(lambda: not (workers & _thread_ids())), "the team's workers are still running"
    assert float(values.sum()) == expected  # a new team starts for the next parallel region
    assert _kernels.release_openmp_workers()
