"""Bad requests get OpenAI error bodies naming the field and the server keeps serving;
the API key is enforced; clients that disconnect free their KV blocks; a model without a
chat template and a dead engine get clear errors. Loopback only, bounded loops."""

from __future__ import annotations

import socket

import httpx
import openai
import pytest
from test_server_api import wait_idle

from pyengine import AsyncEngine, EngineConfig
from pyengine.engine.core import EngineCore
from pyengine.server import ServerArgs
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.faults import install_faulty_runner
from pyengine.testing.live_server import LiveServer
from pyengine.testing.synthetic_runner import SleepRunner
from pyengine.testing.waits import wait_until

MODEL = "tiny-err"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    engine = AsyncEngine(path, max_num_seqs=32, max_model_len=256, num_kv_blocks=256)
    with LiveServer(engine, ServerArgs(model_name=MODEL, max_n=4, stats_interval=0)) as server:
        yield server, engine
    engine.shutdown()


def post(server, path: str, body=None, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30, **kwargs)


def assert_error(resp: httpx.Response, status: int, param):
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert error["message"]
    return error


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "n": 5}, "n"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"prompt": 3.5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 2, 99999]}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": [5] * 300}, "prompt"),
    ({"prompt": [5] * 200, "max_tokens": 100}, "max_tokens"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "hi", "min_tokens": 20, "max_tokens": 4}, "min_tokens"),
    ({"prompt": "hi", "n": 2, "seed": 2**63 - 1}, "seed"),
])
def test_bad_completion_requests_are_400_naming_the_field(served, body, param):
    server, _ = served
    error = assert_error(post(server, "/v1/completions", body), 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x" * 2000}]}, "messages"),
])
def test_bad_chat_requests_are_400_naming_the_field(served, body, param):
    server, _ = served
    assert_error(post(server, "/v1/chat/completions", body), 400, param)


def test_chat_template_kwargs_cannot_break_rendering(served):
    server, _ = served
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
            "chat_template_kwargs": {"add_generation_prompt": False, "messages": []}}
    resp = post(server, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text


def test_logprobs_of_excluded_tokens_are_finite(served):
    """top-k leaves most tokens at -inf; JSON cannot carry that, so they come back floored."""
    server, _ = served
    resp = post(server, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "top_k": 1,
                                            "logprobs": 3, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    tops = resp.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert all(-9999.0 <= v <= 0.0 for top in tops for v in top.values())
    chat = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                 "max_tokens": 3, "top_k": 1, "logprobs": True,
                                                 "top_logprobs": 3, "ignore_eos": True})
    assert chat.status_code == 200, chat.text
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert all(-9999.0 <= t["logprob"] <= 0.0 for t in content)


def test_unexpected_server_errors_are_500_with_an_openai_body():
    from pyengine.server.errors import to_api_error

    error = to_api_error(ValueError("a bug deep in the executor"))
    assert error.status == 500
    from pyengine import InvalidRequestError

    assert to_api_error(InvalidRequestError("max_tokens must be >= 1, got 0")).status == 400


def test_a_value_errors_field_is_the_param_in_the_requests_spelling():
    from pyengine.server.errors import from_value_error

    error = from_value_error(ValueError("beam_width must be <= 6, got 7"), {"beam_width": "n"})
    assert (error.status, error.param, error.message) == (400, "n", "n must be <= 6, got 7")
    error = from_value_error(ValueError("early_stopping must be a bool or 'never'"))
    assert error.param == "early_stopping"
    error = from_value_error(ValueError("a prompt is empty (0 tokens)"), {"prompt": "messages"})
    assert error.param is None and error.message == "a prompt is empty (0 tokens)"


def test_malformed_json_is_400_and_the_server_keeps_serving(served):
    server, _ = served
    resp = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "hi",', timeout=10,
                      headers={"content-type": "application/json"})
    assert_error(resp, 400, None)
    ok = post(server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2


def test_the_openai_client_raises_bad_request(served):
    server, _ = served
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=10) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    assert info.value.body["param"] == "max_tokens"


def test_api_key_is_enforced(served):
    server, engine = served
    with LiveServer(engine, ServerArgs(model_name=MODEL, api_key="sesame", stats_interval=0)) as guarded:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            resp = httpx.get(f"{guarded.url}/v1/models", headers=headers, timeout=10)
            assert_error(resp, 401, None)
        assert httpx.get(f"{guarded.url}/health", timeout=10).status_code == 200
        with openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="sesame", max_retries=0, timeout=10) as client:
            assert client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=2).choices
        with openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="nope", max_retries=0, timeout=10) as client:
            with pytest.raises(openai.AuthenticationError):
                client.models.list()


def _generated(engine: AsyncEngine) -> int:
    return engine.stats().generated_tokens


def test_disconnect_mid_stream_aborts_and_frees_blocks(served):
    server, engine = served
    wait_idle(engine)
    before = _generated(engine)
    body = {"prompt": [5, 6, 7], "max_tokens": 250, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
            assert got
            assert engine.stats().num_running == 1
    wait_idle(engine)
    # Aborted well before 250 tokens (a step of this model takes a few ms).
    assert _generated(engine) - before < 250


def test_disconnect_of_a_non_streaming_request_aborts_it(served):
    server, engine = served
    wait_idle(engine)
    before = _generated(engine)
    body = b'{"prompt": [5, 6, 7], "max_tokens": 250, "ignore_eos": true}'
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(request)
        wait_until(lambda: engine.stats().num_running > 0, 5, interval=0.005)
    wait_idle(engine)
    assert _generated(engine) - before < 250


@pytest.fixture(scope="module")
def synthetic():
    """An engine without a model (no chat template), with its own server."""
    core = EngineCore(EngineConfig(max_num_seqs=8), runner=SleepRunner(0.001))
    engine = AsyncEngine.from_engine_core(core)
    with LiveServer(engine, ServerArgs(model_name="synthetic", stats_interval=0)) as server:
        yield server, engine
    engine.shutdown()


def test_chat_without_a_template_is_a_clear_400(synthetic):
    server, _ = synthetic
    body = {"messages": [{"role": "user", "content": "hi"}]}
    error = assert_error(post(server, "/v1/chat/completions", body), 400, "messages")
    assert "chat template" in error["message"]
    ok = post(server, "/v1/completions", {"prompt": [1, 2], "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_a_failed_step_is_an_error_response_or_an_error_event(synthetic):
    server, engine = synthetic
    faults = install_faulty_runner(engine.engine_core)
    body = {"prompt": [1, 2], "max_tokens": 50, "ignore_eos": True}
    faults.fail_after(3)
    resp = post(server, "/v1/completions", body)
    assert resp.status_code == 500 and "injected failure" not in resp.json()["error"]["message"]
    assert "internal server error" in resp.json()["error"]["message"]
    faults.fail_after(3)
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=10) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2]
    ok = post(server, "/v1/completions", {**body, "max_tokens": 3})
    assert ok.status_code == 200


def test_an_unexpected_exception_is_a_500_and_counted(synthetic, monkeypatch):
    server, engine = synthetic

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in a handler")

    before = _errors_500(server)
    monkeypatch.setattr(engine, "generate", broken)
    resp = post(server, "/v1/completions", {"prompt": [1, 2], "max_tokens": 3})
    monkeypatch.undo()
    assert resp.status_code == 500 and "a bug in a handler" not in resp.json()["error"]["message"]
    assert _errors_500(server) == before + 1


def test_the_guard_counts_a_500_that_starlette_answers_past_it():
    """An exception no handler turns into a response is answered by Starlette's outermost
    middleware, after it has passed the guard: the guard counts it on the way out."""
    import asyncio

    from pyengine.server.guard import GuardMiddleware

    class Counter:
        def __init__(self):
            self.counts = {}

        def labels(self, *labels):
            counter = self

            class Child:
                def inc(self):
                    counter.counts[labels] = counter.counts.get(labels, 0) + 1

            return Child()

    async def failing_app(scope, receive, send):
        raise RuntimeError("a bug below every handler")

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        raise AssertionError("nothing is sent by the failing app")

    errors = Counter()
    guard = GuardMiddleware(failing_app, api_key=None, errors=errors, model_name="m")
    with pytest.raises(RuntimeError):
        asyncio.run(guard({"type": "http", "path": "/v1/completions", "headers": []}, receive, send))
    assert errors.counts == {("m", "500"): 1}


def _errors_500(server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pyengine:http_request_errors_total") and 'status="500"' in line)


def test_a_dead_engine_is_503_and_unhealthy(synthetic):
    server, engine = synthetic
    engine.engine_core.sched._inject_panic()
    wait_until(lambda: not engine.is_alive, 5, interval=0.01)
    assert_error(post(server, "/v1/completions", {"prompt": [1, 2], "max_tokens": 3}), 503, None)
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "dead"
