"""What both engine clients share (``pyengine/entrypoints/engine_client.py``): a request's stream up to
its finished output, aborted at once when the consumer leaves early, and a long text
prompt tokenized off the event loop, so that other streams go on meanwhile. Each runs on
the in-process ``AsyncEngine`` and on ``MultiprocessEngine``; every wait is bounded."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from pyengine import EngineConfig, SamplingParams, make_engine_client
from pyengine.entrypoints.engine_client import until_finished
from pyengine.errors import EngineError, InvalidRequestError
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.waits import wait_engine_idle
from pyengine.text.encode import LONG_TEXT_CHARS

WAIT_S = 30.0  # a bound, never an expectation: each wait below ends long before it on success


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("streams") / "qwen3", "qwen3", seed=3)


@pytest.fixture(scope="module", params=["in-process", "multiprocess"])
def engine(request, checkpoint):
    config = EngineConfig.from_kwargs(str(checkpoint), max_num_seqs=8, num_kv_blocks=256, max_model_len=512)
    eng = make_engine_client(config, multiprocess=request.param == "multiprocess")
    yield eng
    eng.shutdown()


# ---- until_finished on its own ----

def _queue(*items):
    queue: asyncio.Queue = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    return queue


def test_until_finished_stops_at_the_finished_output_and_does_not_abort():
    aborted = []

    async def go():
        queue = _queue(SimpleNamespace(finished=False), SimpleNamespace(finished=True), "never read")
        return [o async for o in until_finished(queue, lambda: aborted.append(1))]

    outs = asyncio.run(go())
    assert [o.finished for o in outs] == [False, True] and aborted == []


def test_until_finished_raises_an_error_put_in_the_queue_without_aborting():
    aborted = []

    async def go():
        queue = _queue(SimpleNamespace(finished=False), EngineError("the request failed"))
        return [o async for o in until_finished(queue, lambda: aborted.append(1))]

    with pytest.raises(EngineError, match="the request failed"):
        asyncio.run(go())
    assert aborted == []


def test_until_finished_aborts_once_when_the_consumer_is_cancelled():
    aborted = []

    async def go():
        queue = _queue(SimpleNamespace(finished=False))  # then nothing: the consumer waits

        async def consume():
            async for _ in until_finished(queue, lambda: aborted.append(1)):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert aborted == [1]


# ---- on both engines ----

def test_leaving_a_stream_early_aborts_at_once(engine, monkeypatch):
    """``aclose`` of ``generate`` closes the inner generators at once (``aclosing``): the
    abort has happened when ``aclose`` returns, not when a garbage collector runs."""
    aborted: list[str] = []
    if hasattr(engine, "engine_core"):  # in-process: the core's abort
        real = engine.engine_core.abort
        monkeypatch.setattr(engine.engine_core, "abort", lambda rid: (aborted.append(rid), real(rid)))
    else:
        real = engine._abort_now
        monkeypatch.setattr(engine, "_abort_now", lambda rid: (aborted.append(rid), real(rid)))

    async def go():
        outputs = engine.generate([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True), "leaver")
        first = await outputs.__anext__()
        assert not first.finished
        await outputs.aclose()
        return list(aborted)

    assert asyncio.run(go()) == ["leaver"]
    assert wait_engine_idle(engine, WAIT_S), "the aborted request is still in the engine"


def test_a_long_text_prompt_does_not_stall_another_stream(engine, monkeypatch):
    """The long prompt's tokenizer is held until the other stream has received an output
    while it was tokenizing. Tokenizing on the event loop would block that loop, so the
    other stream could not move and the hold would run out (bounded) with nothing
    received: the ordering, not a clock, is what the test checks."""
    tokenizing = threading.Event()
    progressed = threading.Event()
    held: list[bool] = []
    real = engine.tokenize

    def slow_tokenize(text, add_special_tokens=True):
        if len(text) > LONG_TEXT_CHARS:
            tokenizing.set()
            held.append(progressed.wait(WAIT_S))  # True: the other stream moved meanwhile
        return real(text, add_special_tokens)

    monkeypatch.setattr(engine, "tokenize", slow_tokenize)
    long_text = "hello world " * (LONG_TEXT_CHARS // 12 + 10)

    async def other_stream():
        async for out in engine.generate([5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True), "other"):
            if tokenizing.is_set():
                progressed.set()  # an output arrived while the long prompt was being tokenized
            if progressed.is_set() or out.finished:
                break

    async def long_stream():
        # Longer than the tiny model's context once tokenized: refused, after tokenizing.
        with pytest.raises(InvalidRequestError, match="prompt"):
            async for _ in engine.generate(long_text, SamplingParams(max_tokens=2), "long"):
                pass

    async def go():
        other = asyncio.ensure_future(other_stream())
        await asyncio.sleep(0)
        await asyncio.wait_for(long_stream(), WAIT_S * 2)
        await asyncio.wait_for(other, WAIT_S)

    asyncio.run(go())
    assert held == [True], "the other stream made no progress while the long prompt was tokenized"
