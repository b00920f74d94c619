"""release_openmp_workers frees the calling thread's OpenMP team, which comes back on demand."""

from __future__ import annotations

import os
import time

import pytest
import torch

from pyengine import _sched


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc")
def test_release_frees_the_calling_threads_workers_and_they_come_back():
    workers = torch.get_num_threads() - 1
    if workers < 1:
        pytest.skip("PyTorch runs one intra-op thread here: no workers to free")
    values = torch.arange(4_000_000, dtype=torch.float64)
    expected = float(values.sum())  # large enough for a parallel region: this thread has a team now
    before = _thread_count()
    if not _sched.release_openmp_workers():
        pytest.skip("libgomp is not loaded or has no omp_pause_resource_all")
    deadline = time.monotonic() + 5
    while _thread_count() > before - workers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _thread_count() == before - workers
    assert float(values.sum()) == expected  # a new team starts for the next parallel region
    assert _sched.release_openmp_workers()  # and can be released again
