"""release_openmp_workers frees the calling thread's OpenMP team, which comes back on demand;
the executor loop frees its own once the engine has no requests."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from pyengine import _kernels
from pyengine.engine.executor_loop import ExecutorLoop
from pyengine.testing.waits import wait_until


def _thread_ids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _wait_until(condition, seconds: float = 5.0) -> bool:
    return wait_until(condition, seconds, interval=0.01)


@pytest.fixture
def two_threads():
    """Two intra-op threads for the test (an earlier test may have left PyTorch at one:
    then there would be no workers to free), restored after."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: PyTorch runs no OpenMP workers to free")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc")
def test_release_frees_the_calling_threads_workers_and_they_come_back(two_threads):
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


class _OneStepScheduler:
    """Hands the executor loop one plan, then none (each wait its whole timeout)."""

    def __init__(self) -> None:
        self.plans = [SimpleNamespace(step_id=0, new_seq_ids=[])]
        self.submitted = threading.Event()

    def next_plan(self, timeout: float):
        if self.plans:
            return self.plans.pop()
        time.sleep(timeout)
        return None

    def submit_result(self, step_id, sampled, result, **drafts) -> None:
        self.submitted.set()


class _ParallelRunner:
    """A step that runs parallel regions on the executor thread (so it gets a team) and
    records that team's worker threads."""

    def __init__(self) -> None:
        self.workers: set[str] = set()

    def execute(self, plan):
        before = _thread_ids()
        torch.arange(4_000_000, dtype=torch.float64).sum()
        self.workers = _thread_ids() - before
        return SimpleNamespace(num_accepted=None, next_drafts=None, sampled_token_ids=None, logprobs=None,
                               pooled=None, row_errors=None, prompt_logprobs=None)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc")
def test_an_executor_with_no_requests_frees_its_team(two_threads):
    # Another engine's idle team would throttle the running one's (libgomp counts them all).
    if not _kernels.release_openmp_workers():
        pytest.skip("libgomp is not loaded or has no omp_pause_resource_all")
    live = threading.Event()
    live.set()
    sched, runner = _OneStepScheduler(), _ParallelRunner()
    loop = ExecutorLoop(runner, sched, has_requests=live.is_set)
    thread = threading.Thread(target=loop.run)
    thread.start()
    try:
        assert sched.submitted.wait(10), "the step did not finish"
        assert runner.workers, "the step's parallel region started no worker thread"
        time.sleep(0.1)
        assert runner.workers <= _thread_ids(), "freed while requests were live"
        live.clear()  # the engine goes idle: its executor frees the team within a wait or two
        assert _wait_until(lambda: not (runner.workers & _thread_ids())), "the idle executor kept its team"
    finally:
        loop.stopping.set()
        thread.join(5)
    assert not thread.is_alive()
