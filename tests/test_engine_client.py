"""``EngineClient``: ``AsyncEngine`` implements it with plain data, and the server works
with any implementation of it (a fake here, a multi-process client next)."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Optional

import httpx
import pytest

from pyengine import AsyncEngine, EngineConfig, InvalidRequestError
from pyengine.engine.core import EngineCore
from pyengine.entrypoints.engine_client import EngineClient
from pyengine.outputs import (
    CompletionOutput,
    EmbeddingRequestOutput,
    EngineHealth,
    EngineStats,
    RequestMetrics,
    RequestOutput,
    ThreadStack,
)
from pyengine.server import ServerArgs
from pyengine.server.health import diagnose
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.live_server import LiveServer
from pyengine.testing.synthetic_runner import SleepRunner
from pyengine.testing.waits import wait_until


@pytest.fixture(scope="module")
def synthetic():
    engine = AsyncEngine.from_engine_core(EngineCore(EngineConfig(max_num_seqs=8), runner=SleepRunner(0.001)))
    yield engine
    engine.shutdown()


async def _generate(engine: EngineClient, ids: list[int], max_tokens: int) -> RequestOutput:
    from pyengine import SamplingParams

    last = None
    async for out in engine.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=max_tokens,
                                                                                ignore_eos=True)):
        last = out
    assert last is not None and last.finished
    return last


def test_async_engine_is_an_engine_client_of_plain_data(synthetic):
    engine = synthetic
    assert isinstance(engine, EngineClient)
    before = engine.health()
    assert isinstance(before, EngineHealth) and before.alive and before.num_unfinished == 0
    out = asyncio.run(_generate(engine, [1, 2, 3], 5))
    assert len(out.outputs[0].token_ids) == 5
    # The executor counts a step after handing its result over, so the last count may
    # land just after the output was delivered: wait for it, briefly.
    wait_until(lambda: engine.health().steps >= before.steps + 5, 5, interval=0.01)
    after = engine.health()
    assert after.steps >= before.steps + 5 and after.dead_reason is None
    for value in (after, engine.thread_stacks(), engine.stats()):
        pickle.dumps(value)  # crosses a process boundary as it is
    assert engine.model_path == "<synthetic>" and engine.max_model_len == 4096
    assert engine.max_logprobs == engine.engine_core.config.max_logprobs
    assert engine.tokenizer_config == {} and engine.chat_template is None
    assert engine.vocab_size == engine.tokenizer.get_vocab_size()  # no model config: the tokenizer's


def test_thread_stacks_name_the_engines_own_threads(synthetic):
    threads = {t.role: t for t in synthetic.thread_stacks()}
    assert set(threads) == {"scheduler", "executor", "output"}
    assert threads["scheduler"].native and threads["scheduler"].stack is None
    assert set(synthetic.stats().threads) == {t.name for t in threads.values()}
    for role in ("executor", "output"):
        t = threads[role]
        assert not t.native and t.native_id is not None and t.stack and "pyengine" in "".join(t.stack)


def test_text_helpers(synthetic):
    ids = synthetic.tokenize("Hello world")
    assert ids and synthetic.decode(ids) == "Hello world"
    plain = synthetic.tokenize("Hello world", add_special_tokens=False)
    assert plain == list(synthetic.tokenizer.encode("Hello world", add_special_tokens=False).ids)
    table = synthetic.token_bytes
    assert table is not None and b"".join(table[t] for t in plain) == b"Hello world"


def test_tiny_checkpoint_surface(tmp_path):
    engine = AsyncEngine(make_tiny_checkpoint(tmp_path / "ckpt"), max_num_seqs=4, max_model_len=128,
                         num_kv_blocks=64)
    try:
        assert isinstance(engine.chat_template, str) and "chat_template" in engine.tokenizer_config
        assert engine.vocab_size == engine.engine_core.vocab_size and engine.max_model_len == 128
        assert engine.model_path == str(tmp_path / "ckpt")
    finally:
        engine.shutdown()
    assert not engine.is_alive and engine.health().dead_reason is not None


# ---- the server against a fake client: it needs nothing beyond the interface ----


class FakeClient(EngineClient):
    """Every request "generates" ``abc`` in three deltas; no engine behind it."""

    def __init__(self) -> None:
        self.steps = 0
        self.aborted: list[str] = []

    async def generate(self, prompt: Any, sampling_params: Any = None, request_id: Optional[str] = None, *,
                       output_kind: Any = "cumulative", priority: int = 0) -> AsyncIterator[RequestOutput]:
        ids = list(prompt["prompt_token_ids"])
        metrics = RequestMetrics(arrival_time=time.time(), first_scheduled_time=time.time())
        for i, text in enumerate("abc"):
            await asyncio.sleep(0)
            self.steps += 1
            done = i == 2
            if done:
                metrics.first_token_time = metrics.finished_time = time.time()
            sample = CompletionOutput(0, text, [10 + i], finish_reason="length" if done else None)
            yield RequestOutput(request_id or "fake", None, ids, [sample], done, metrics)

    async def embed(self, prompt: Any, pooling_params: Any = None,
                    request_id: Optional[str] = None) -> EmbeddingRequestOutput:
        raise NotImplementedError

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    model_path = "/fake/model"
    max_model_len = 64
    vocab_size = 100
    max_logprobs = 5
    eos_token_ids: list[int] = []
    tokenizer_config: dict[str, Any] = {}
    tokenizer = None
    token_bytes: Optional[Sequence[bytes]] = None

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise InvalidRequestError("no tokenizer")

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""

    def health(self) -> EngineHealth:
        return EngineHealth(None, self.steps, 0)

    def thread_stacks(self) -> list[ThreadStack]:
        return [ThreadStack("fake-sched", "scheduler", True), ThreadStack("fake-exec", "executor", False, 1, None),
                ThreadStack("fake-out", "output", False, 2, None)]

    def stats(self) -> EngineStats:
        return EngineStats(threads={"fake-sched": {"busy_s": 0.0, "idle_s": 1.0}}, steps=self.steps,
                           step_time_mean_ms=0.0, step_time_p99_ms=0.0, num_running=0, num_waiting=0,
                           num_preempted_waiting=0, preemptions=0, kv_usage=0.0, kv_blocks_total=1,
                           prefix_cache_hit_rate=0.0, prompt_tokens=0, generated_tokens=self.steps,
                           queue_depths={})

    def shutdown(self, timeout: float = 10.0) -> None:
        pass


def test_the_server_runs_on_any_engine_client():
    fake = FakeClient()
    with LiveServer(fake, ServerArgs(model_name="fake", stats_interval=0)) as server:
        url = server.url
        resp = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 3}, timeout=10)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == "abc" and resp.json()["usage"]["completion_tokens"] == 3
        with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": [1, 2], "stream": True},
                          timeout=10) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data:")]
        assert len(lines) == 4 and lines[-1] == "data: [DONE]"
        assert httpx.post(f"{url}/v1/completions", json={"prompt": [1, 200]}, timeout=10).status_code == 400
        chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                          timeout=10)
        assert chat.status_code == 400 and "chat template" in chat.json()["error"]["message"]
        assert httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["root"] == "fake"  # never the path
        assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
        assert "pyengine:engine_steps_total" in httpx.get(f"{url}/metrics", timeout=10).text
    dump = diagnose(fake)
    assert dump["stuck_thread"].startswith("fake-sched") and "--- fake-exec (Python)" in dump["stack"]
    assert dump["fake-sched"]["idle_s"] == 1.0
    assert dataclasses.is_dataclass(fake.health())


def test_diagnose_reports_an_engine_that_cannot_list_its_threads():
    """A dead link or a core that does not answer: the stall dump says so instead of
    raising out of the watchdog's diagnosis."""
    from pyengine.errors import EngineDeadError

    class NoStacks(FakeClient):
        def thread_stacks(self):
            raise EngineDeadError("engine core 0 is unreachable")

    dump = diagnose(NoStacks())
    assert "unreachable" in dump["stacks_error"] and "stuck_thread" in dump and "stack" in dump
