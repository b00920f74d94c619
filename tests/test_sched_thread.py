"""The scheduler thread driven like the engine drives it, with a fake executor."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from pyengine import EngineDeadError, Request, Scheduler, SchedulerConfig, SchedulerThread
from pyengine.devtools.fake_executor import FakeExecutor, drive
from pyengine.testing.waits import wait_until


def workload(n: int = 300, seed: int = 0, shared_prefix: int = 0, eos: bool = False) -> list[Request]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, 1000, shared_prefix).tolist()
    reqs = []
    for i in range(n):
        prompt = prefix + rng.integers(0, 1000, int(rng.integers(1, 60))).tolist()
        reqs.append(
            Request(
                f"req-{i}",
                prompt,
                max_tokens=int(rng.integers(1, 40)),
                ignore_eos=not eos,
                eos_token_ids=[7] if eos else [],
                n=2 if i % 17 == 0 else 1,
            )
        )
    return reqs


def start(num_blocks: int = 4096, **kw) -> SchedulerThread:
    kw.setdefault("block_size", 16)
    kw.setdefault("max_num_seqs", 64)
    kw.setdefault("max_num_batched_tokens", 512)
    kw.setdefault("max_model_len", 256)
    return SchedulerThread(SchedulerConfig(num_blocks, **kw))


def run(reqs, **kw):
    t = start(**kw)
    try:
        result = drive(t, reqs, FakeExecutor(vocab=50))
        stats = t.stats()
    finally:
        t.shutdown()
    assert stats["kv_blocks_used"] == 0, stats
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    return result, stats


def test_depth_one_and_two_give_identical_streams():
    one, _ = run(workload(eos=True), pipeline_depth=1)
    two, stats = run(workload(eos=True), pipeline_depth=2)
    assert one.tokens == two.tokens
    assert one.finish_reasons == two.finish_reasons
    assert any(r == "stop" for rs in two.finish_reasons.values() for r in rs), "EOS should end some"
    assert stats["discarded_tokens"] > 0, "depth 2 plans past EOS and drops the extra token"
    for rid, outs in two.tokens.items():
        assert all(len(o) > 0 for o in outs), rid


def test_tiny_pool_preempts_and_still_gives_the_same_tokens():
    reference, _ = run(workload(120, seed=1))
    squeezed, stats = run(workload(120, seed=1), num_blocks=40, pipeline_depth=2)
    assert stats["preemptions"] > 0 and squeezed.num_preemptions > 0
    assert squeezed.tokens == reference.tokens


def test_prefix_hits_are_counted():
    result, stats = run(workload(50, seed=2, shared_prefix=64), max_num_batched_tokens=128)
    assert stats["prefix_cache_hit_tokens"] >= 48 * 64 * 0.5
    assert sum(result.num_cached_tokens.values()) > 0


def test_abort_frees_blocks_and_ends_streams():
    t = start(pipeline_depth=2)
    try:
        ex = FakeExecutor(vocab=50)
        for i in range(20):
            t.add_request(Request(f"a{i}", list(range(1, 40)), max_tokens=200, ignore_eos=True))
        for _ in range(5):  # get everything running, with steps in flight
            plan = t.next_plan(timeout=5)
            t.submit_result(plan.step_id, ex.run(plan))
        plan = t.next_plan(timeout=5)  # keep one step in flight across the aborts
        for i in range(20):
            t.abort(f"a{i}")
        t.submit_result(plan.step_id, ex.run(plan))
        aborted = 0
        deadline = time.time() + 10
        while aborted < 20 and time.time() < deadline:
            plan = t.next_plan(timeout=0.01)
            if plan is not None:
                t.submit_result(plan.step_id, ex.run(plan))
            ev = t.next_output(timeout=0.01)
            if ev is not None:
                aborted += int((ev.finish_reasons == 2).sum())
        assert aborted == 20
        deadline = time.time() + 5
        while t.stats()["kv_blocks_used"] and time.time() < deadline:
            plan = t.next_plan(timeout=0.05)
            if plan is not None:
                t.submit_result(plan.step_id, ex.run(plan))
        stats = t.stats()
        assert stats["kv_blocks_used"] == 0, stats
        # The ids are free again.
        t.add_request(Request("a0", [1, 2, 3], max_tokens=1))
    finally:
        t.shutdown()


def test_gil_is_released_while_a_4096_request_step_is_planned():
    n = 4096
    sched = Scheduler(
        SchedulerConfig(n * 40, max_num_seqs=n, max_num_batched_tokens=n * 512, max_model_len=600,
                        enable_prefix_caching=False)  # every prompt token is computed
    )
    for i in range(n):
        sched.add_request(Request(f"g{i}", [i % 1000 + 1] * 512, max_tokens=8, ignore_eos=True))
    ticks: list[float] = []
    stop = threading.Event()

    def count() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            if i % 200 == 0:
                ticks.append(time.perf_counter())

    counting = threading.Thread(target=count)
    counting.start()
    try:
        assert wait_until(lambda: ticks, 10, interval=0.001), "the counting thread did not start"
        started = time.perf_counter()
        plan = sched.schedule()  # plans 4096 prompts (2M tokens) with the GIL released
        ended = time.perf_counter()
    finally:
        stop.set()
        counting.join()
    assert plan.num_seqs == n and plan.num_tokens == n * 512
    inside = [t for t in ticks if started < t < ended]
    assert ended - started > 0.005, "the step was too cheap to tell anything"
    assert len(inside) > 0, "the counting thread made no progress while the step was planned"


def test_thread_is_named_and_shutdown_joins_with_work_in_flight():
    t = start()
    ex = FakeExecutor(vocab=50)
    for i in range(30):
        t.add_request(Request(f"s{i}", [1, 2, 3, 4], max_tokens=100, ignore_eos=True))
    plan = t.next_plan(timeout=5)
    t.submit_result(plan.step_id, ex.run(plan))
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    assert "pyengine-sched" in names
    # Nobody drains outputs or plans any more; shutdown must still join promptly.
    started = time.time()
    t.shutdown(timeout=5)
    assert time.time() - started < 5
    assert not t.is_alive
    with pytest.raises(EngineDeadError):
        t.add_request(Request("late", [1]))


def test_a_panicking_scheduler_thread_is_reported_not_hung():
    t = start()
    t._inject_panic()
    with pytest.raises(EngineDeadError, match="panicked"):
        t.next_plan(timeout=10)
    assert "panicked" in t.death
    with pytest.raises(EngineDeadError):
        t.add_request(Request("x", [1]))
    t.shutdown()
