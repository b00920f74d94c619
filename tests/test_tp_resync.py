"""Rank 0 failing part-way through a step at tensor-parallel size 2: it issues exactly
the collectives it still owes, so the worker finishes the step with it and the next
request gives the same tokens as before the failure; when even that fails, the engine is
dead with a message saying the ranks are out of step (never mismatched collectives)."""

from __future__ import annotations

import threading
import time

import pytest
from test_tp_engine import _engine, _submit, _workers

import pyengine.executor.tensor_parallel.collective_step as collective_step
from pyengine.errors import EngineDeadError
from pyengine.models.parallel import ParallelContext
from pyengine.testing.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tp_resync") / "qwen3", "qwen3", seed=5)


class RankZeroFault:
    """Fails rank 0's all-reduces (this process is rank 0; the worker is another process)
    from the ``after``-th of a step on, ``times`` times, while armed."""

    def __init__(self, monkeypatch, error: type[BaseException], after: int, times: int) -> None:
        self.armed = threading.Event()
        self.error, self.after, self.left = error, after, times
        real = ParallelContext.all_reduce

        def all_reduce(context: ParallelContext, tensor):
            if self.armed.is_set() and context.count.all_reduces >= self.after and self.left > 0:
                self.left -= 1
                raise self.error("injected: rank 0 fails part-way through its step")
            return real(context, tensor)

        monkeypatch.setattr(ParallelContext, "all_reduce", all_reduce)


def _tokens(core, request_id) -> list[int]:
    sink = _submit(core, request_id, [5, 6, 7, 8], max_tokens=6)
    assert sink.done.wait(60) and sink.error is None, sink.error
    return sink.outputs[-1].outputs[0].token_ids


def _failed_with(sink) -> str:
    assert sink.done.wait(60), "the request was left waiting"
    return str(sink.error or sink.outputs[-1])


def test_a_fault_between_all_reduces_resynchronises(qwen3, monkeypatch):
    fault = RankZeroFault(monkeypatch, ValueError, after=2, times=1)
    core = _engine(qwen3)
    try:
        before = _tokens(core, "before")
        fault.armed.set()
        assert "rank 0" in _failed_with(_submit(core, "victim", [9, 10, 11]))
        fault.armed.clear()
        assert _tokens(core, "after") == before
        assert core.is_alive
    finally:
        core.shutdown()
    assert _workers() == set()


def test_a_fault_after_every_all_reduce_issues_only_the_gather(qwen3, monkeypatch):
    """Before: the whole step's all-reduces were issued again, against the worker's gather."""
    real = collective_step.encode_message
    armed = threading.Event()

    def encode_message(text: str, failed: bool):
        if armed.is_set():
            armed.clear()
            raise ValueError("injected: rank 0 fails preparing the gather")
        return real(text, failed)

    monkeypatch.setattr(collective_step, "encode_message", encode_message)
    core = _engine(qwen3)
    try:
        before = _tokens(core, "before")
        armed.set()
        assert "preparing the gather" in _failed_with(_submit(core, "victim", [9, 10, 11]))
        assert _tokens(core, "after") == before
        assert core.is_alive
    finally:
        core.shutdown()
    assert _workers() == set()


def test_ranks_that_cannot_be_resynchronised_make_the_engine_dead(qwen3, monkeypatch):
    fault = RankZeroFault(monkeypatch, MemoryError, after=2, times=10**9)
    core = _engine(qwen3)
    try:
        _tokens(core, "before")
        fault.armed.set()
        victim = _submit(core, "victim", [9, 10, 11])
        assert victim.done.wait(60), "the request was left waiting"
        deadline = time.monotonic() + 10
        while core.is_alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not core.is_alive
        assert "out of step" in core.dead_reason() and "2 of 5 all-reduces" in core.dead_reason()
        with pytest.raises(EngineDeadError, match="out of step"):
            _submit(core, "after", [5, 6])
    finally:
        core.shutdown(timeout=15)
    assert _workers() == set()
