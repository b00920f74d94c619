"""An abort that meets a full engine-core queue (the core stalled: SIGSTOP here, a long
GC pause or a slow host elsewhere) is kept and sent again by the front end's heartbeat
thread once there is room, not dropped: otherwise the core generates the request up to
``max_tokens`` for nobody. Real core process, bounded waits, the core resumed in any case."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import zmq

from pyengine.config import EngineConfig
from pyengine.errors import EngineDeadError, EngineError
from pyengine.multiprocess import wire
from pyengine.multiprocess.client import MultiprocessEngine
from pyengine.multiprocess.link_options import LinkOptions
from pyengine.sampling_params import SamplingParams
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.waits import wait_until

MAX_TOKENS = 3000


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("mp_abort") / "qwen3", "qwen3", seed=7)  # 4096 positions


def fill_queue(engine: MultiprocessEngine, index: int, limit: int = 2_000_000) -> int:
    """Heartbeats to stopped core ``index`` until its queue stays full: how many went.

    The first ``zmq.Again`` is not the end: zmq's I/O thread goes on moving queued
    messages into the socket's kernel buffer for a moment, which makes room again. Full
    is when a whole round finds no room after a pause."""
    total = 0
    for _ in range(100):
        sent = 0
        while total + sent < limit:
            try:
                engine._send(index, wire.Heartbeat())
                sent += 1
            except zmq.Again:
                break
        total += sent
        if sent == 0 and total > 0:
            return total
        time.sleep(0.2)
    raise AssertionError("the core's queue never filled")


def test_an_abort_that_meets_a_full_core_queue_is_sent_once_there_is_room(checkpoint):
    config = EngineConfig(model=str(checkpoint), max_model_len=4096, num_kv_blocks=300, max_num_seqs=4)
    # A long heartbeat timeout: the stopped core must not take the pause for a dead front end.
    engine = MultiprocessEngine(config, LinkOptions(heartbeat_timeout=60.0))
    pid = engine.core_pids[0]
    assert pid is not None

    async def abort_while_stalled() -> tuple[int, bool]:
        outputs = engine.generate([5, 6, 7], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), "victim")
        await asyncio.wait_for(outputs.__anext__(), 60)  # it is generating
        os.kill(pid, signal.SIGSTOP)
        try:
            filled = fill_queue(engine, 0)
            await outputs.aclose()  # the caller leaves: its abort meets the full queue
            return filled, "victim" in engine._pending_aborts
        finally:
            os.kill(pid, signal.SIGCONT)

    try:
        filled, kept = asyncio.run(abort_while_stalled())
        assert filled > 0 and kept, "the abort that met a full queue was not kept"
        # The request's last output (aborted, or at max_tokens) ends its stream here.
        assert wait_until(lambda: "victim" not in engine._streams and not engine._pending_aborts, 120.0), \
            "the request never ended"
        generated = engine.stats().generated_tokens
        assert generated < MAX_TOKENS, f"the aborted request ran to max_tokens ({generated} tokens)"
        assert engine.health().dead_reason is None
    finally:
        os.kill(pid, signal.SIGCONT)
        engine.shutdown()


def test_a_query_that_meets_a_full_core_queue_is_an_error_not_a_death(checkpoint):
    """stats() / thread_stacks() ask every core; a full queue says so at once (try again),
    not "unreachable" as a dead core would, and the engine stays alive."""
    config = EngineConfig(model=str(checkpoint), max_model_len=4096, num_kv_blocks=300, max_num_seqs=4)
    engine = MultiprocessEngine(config, LinkOptions(heartbeat_timeout=60.0))
    pid = engine.core_pids[0]
    assert pid is not None
    try:
        os.kill(pid, signal.SIGSTOP)
        try:
            assert fill_queue(engine, 0) > 0
            with pytest.raises(EngineError, match="queue is full") as caught:
                engine.thread_stacks()
            assert not isinstance(caught.value, EngineDeadError)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert engine.health().dead_reason is None
        assert wait_until(lambda: _answers(engine), 60.0), "the resumed core never answered"
    finally:
        os.kill(pid, signal.SIGCONT)
        engine.shutdown()


def _answers(engine: MultiprocessEngine) -> bool:
    try:
        engine.stats()
        return True
    except EngineError:
        return False  # its queue still holds the heartbeats that filled it
