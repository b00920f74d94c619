"""The engine's threads, failures, aborts, interrupts and shutdown: nothing lost, nothing
hung, no KV block leaked."""

from __future__ import annotations

import _thread
import resource
import signal
import threading
import time

import pytest

from pyengine import LLM, EngineDeadError, EngineError, SamplingParams
from pyengine.engine.thread_names import os_thread_names
from pyengine.testing.faults import FaultySink, install_faulty_runner
from pyengine.testing.waits import wait_until


@pytest.fixture(scope="module")
def llm():
    engine = LLM(max_num_seqs=64, max_num_batched_tokens=1024)
    yield engine
    engine.shutdown()


def assert_idle(llm):
    deadline = time.time() + 5
    while time.time() < deadline:
        stats = llm.stats()
        if stats.kv_usage == 0 and stats.num_running == 0 and stats.num_waiting == 0 \
                and stats.queue_depths["requests"] == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"engine not idle: {stats}")


def test_three_named_threads_are_visible_while_running(llm):
    names = os_thread_names()
    for name in ("pyengine-sched", "pyengine-exec", "pyengine-output"):
        assert name in names, names


def test_executor_exception_fails_the_batch_and_the_engine_recovers(llm):
    install_faulty_runner(llm.engine_core).fail_after(3)
    with pytest.raises(EngineError, match="injected failure"):
        llm.generate([[5, 6, 7, 8]] * 8, SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert_idle(llm)
    outs = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 5
    assert llm.engine_core.is_alive


def test_output_exception_fails_the_requests_and_the_engine_recovers(llm):
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    faulty, healthy = FaultySink(fail_on=3), FaultySink(fail_on=0)
    llm.engine_core.add_request("faulty-sink", None, [9, 9, 9], params, faulty)
    llm.engine_core.add_request("healthy-sink", None, [9, 9, 8], params, healthy)
    assert faulty.done.wait(30) and healthy.done.wait(30)
    assert isinstance(faulty.error, EngineError) and "output processing failed" in str(faulty.error)
    assert healthy.error is None and len(healthy.outputs[-1].outputs[0].token_ids) == 10
    assert_idle(llm)
    outs = llm.generate([[9, 9, 9]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "length"


class _BrokenStream:
    """A text stream that raises on its second step: an error inside event processing."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def add(self, tokens):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("injected detokenizer failure")
        return self.inner.add(tokens)

    def finish(self):
        return self.inner.finish()


def test_a_processing_error_fails_its_request_and_the_engine_recovers(llm, monkeypatch):
    make_stream = llm.engine_core._text_stream
    monkeypatch.setattr(llm.engine_core, "_text_stream", lambda *args: _BrokenStream(make_stream(*args)))
    sink = FaultySink(fail_on=0)
    llm.engine_core.add_request("broken-stream", None, [9, 9, 9], SamplingParams(max_tokens=10, ignore_eos=True), sink)
    assert sink.done.wait(30)
    assert isinstance(sink.error, EngineError) and "injected detokenizer failure" in str(sink.error)
    monkeypatch.undo()
    assert_idle(llm)
    outs = llm.generate([[9, 9, 9]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "length"


def test_keyboard_interrupt_aborts_the_batch_and_leaves_the_engine_usable(llm):
    # Python's own SIGINT handler for the test: a runner started in the background (`&` in
    # a script) inherits SIGINT ignored, and then interrupt_main does nothing.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        timer = threading.Timer(0.3, _thread.interrupt_main)
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[1, 2, 3, 4]] * 64, SamplingParams(max_tokens=2000, ignore_eos=True), use_tqdm=False)
        timer.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert_idle(llm)
    outs = llm.generate([[1, 2]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 4


def test_n_samples_compute_the_prompt_once(llm):
    prompt = list(range(3, 3 + 160))  # 10 full blocks
    before = llm.stats().scheduler["prefill_tokens_scheduled"]
    out = llm.generate([prompt], SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=7,
                                                ignore_eos=True), use_tqdm=False)[0]
    prefill = llm.stats().scheduler["prefill_tokens_scheduled"] - before
    assert len(out.outputs) == 4 and all(len(o.token_ids) == 6 for o in out.outputs)
    # 160 prompt tokens once; each extra sample recomputes only the last token.
    assert prefill <= 160 + 3 * 16, prefill
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1, "seeded samples must differ"


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([[7, 8, 9, 10]], p, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([[7, 8, 9, 10]], p, use_tqdm=False)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = llm.generate([[1, 2], [7, 8, 9, 10], [3, 4, 5]], [noise, p, noise], use_tqdm=False)
    assert alone == again == mixed[1].outputs[0].token_ids


def test_ten_thousand_short_requests_finish_and_memory_stays_flat(llm):
    params = SamplingParams(max_tokens=2, ignore_eos=True)

    def batch(offset: int):
        prompts = [[(offset + i) % 400 + 3, (i * 7) % 400 + 3, 11] for i in range(5000)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(o.finished and len(o.outputs[0].token_ids) == 2 for o in outs)

    batch(0)
    rss_after_first = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    batch(5000)
    rss_after_second = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert_idle(llm)
    # ru_maxrss is in KiB: the second 5,000 requests may not grow the peak by more than 64 MiB.
    assert rss_after_second - rss_after_first < 64 * 1024, (rss_after_first, rss_after_second)


def test_shutdown_joins_all_threads_with_requests_in_flight():
    engine = LLM(max_num_seqs=8)
    tids = [engine.engine_core.executor.native_id, engine.engine_core.output.native_id]
    errors = []

    def run():
        try:
            engine.generate([[1, 2, 3]] * 8, SamplingParams(max_tokens=3000, ignore_eos=True), use_tqdm=False)
        except EngineDeadError as e:
            errors.append(e)

    caller = threading.Thread(target=run)
    caller.start()
    assert wait_until(lambda: engine.stats().num_running == 8, 60), "the requests did not start"
    started = time.time()
    engine.shutdown(timeout=10)
    caller.join(timeout=10)
    assert not caller.is_alive(), "a caller was left waiting"
    assert time.time() - started < 10
    assert errors and "shut down" in str(errors[0])
    # Joined: the Python threads' OS threads are gone, and so is the scheduler thread.
    # (Worker threads that torch or tokenizers start inherit the names, so names alone
    # do not tell.)
    import os

    # the OS reaps a thread a moment after Python's join
    wait_until(lambda: not any(os.path.exists(f"/proc/self/task/{tid}") for tid in tids), 2, interval=0.01)
    assert not any(os.path.exists(f"/proc/self/task/{tid}") for tid in tids)
    assert not engine.engine_core.sched.is_alive
    with pytest.raises(EngineDeadError):
        engine.generate([[1]], use_tqdm=False)


def test_a_token_outside_the_vocabulary_is_refused_up_front(llm):
    from pyengine import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llm.generate([[1, 2, 3], [1, 2, 10**9]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_idle(llm)
    outs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 2


def test_prompt_tokens_are_counted_for_every_request(llm):
    before = llm.stats().prompt_tokens
    llm.generate([[4, 5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True, stop=["a", "e", "o", " "]),
                 use_tqdm=False)
    assert llm.stats().prompt_tokens == before + 4


class _StreamFailingAt:
    """A text stream that raises on call number ``at`` of ``add`` (or in ``finish`` when
    ``at`` is "finish")."""

    def __init__(self, inner, at):
        self.inner, self.at, self.calls = inner, at, 0

    def add(self, tokens):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError(f"injected fault at token {self.at}")
        return self.inner.add(tokens)

    def finish(self):
        if self.at == "finish":
            raise RuntimeError("injected fault at the end")
        return self.inner.finish()


@pytest.mark.parametrize("at", [1, 3, "finish"])
@pytest.mark.parametrize("victim", range(4))
def test_an_output_fault_at_any_position_fails_only_its_request(llm, monkeypatch, victim, at):
    # Four requests decode in lockstep, so each event carries one token of each; the fault
    # hits one of them (every position of the event over the parametrisation).
    make_stream = llm.engine_core._text_stream
    made = []

    def stream(*args):
        made.append(None)
        return _StreamFailingAt(make_stream(*args), at if len(made) - 1 == victim else None)

    monkeypatch.setattr(llm.engine_core, "_text_stream", stream)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    sinks = [FaultySink(fail_on=0) for _ in range(4)]
    for i, sink in enumerate(sinks):
        llm.engine_core.add_request(f"pos-{victim}-{at}-{i}", None, [7, 7, 7], params, sink)
    for i, sink in enumerate(sinks):
        assert sink.done.wait(30), f"request {i} was left waiting"
        if i == victim:
            assert isinstance(sink.error, EngineError) and "injected fault" in str(sink.error)
        else:
            assert sink.error is None, sink.error
            final = sink.outputs[-1].outputs[0]
            assert len(final.token_ids) == 6 and final.finish_reason == "length"
    monkeypatch.undo()
    assert_idle(llm)


@pytest.mark.parametrize("pooling", [False, True])
def test_a_failure_outside_per_request_work_fails_every_request_the_event_names(llm, monkeypatch, pooling):
    # The first event of a request (the one that starts it) fails outside the per-request
    # guards: the request it names, a generation's token or an embedding's end, must fail
    # rather than wait forever.
    from pyengine import PoolingParams
    from pyengine.engine.output_loop import OutputLoop

    def broken(self, result):
        raise RuntimeError("injected fault outside per-request work")

    monkeypatch.setattr(OutputLoop, "_mark_scheduled", broken)
    sink = FaultySink(fail_on=0)
    params = PoolingParams() if pooling else SamplingParams(max_tokens=5, ignore_eos=True)
    llm.engine_core.add_request(f"outside-{pooling}", None, [4, 5, 6], params, sink)
    assert sink.done.wait(30), "the caller was left waiting"
    assert isinstance(sink.error, EngineError) and "injected fault outside" in str(sink.error)
    monkeypatch.undo()
    assert_idle(llm)

