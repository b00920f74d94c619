"""Resource limits (issue 11 item 4): body and head size, head and body time, concurrent
requests, prompts per request. Each refusal is an OpenAI error body, and the server goes
on serving. Raw sockets where a client library would not misbehave on purpose; a
synthetic engine; loopback only; every wait bounded."""

from __future__ import annotations

import argparse
import json
import socket
import time

import httpx
import pytest

from pyengine import AsyncEngine, EngineConfig
from pyengine.engine.core import EngineCore
from pyengine.server import ServerArgs
from pyengine.server.args import add_limit_flags, limit_kwargs
from pyengine.testing.live_server import LiveServer
from pyengine.testing.synthetic_runner import SleepRunner

LIMITS = dict(max_body_bytes=4096, max_header_bytes=8192, header_timeout=0.5, body_timeout=0.5,
              max_concurrent_requests=2, max_prompts_per_request=3)


@pytest.fixture(scope="module")
def served():
    core = EngineCore(EngineConfig(max_num_seqs=8), runner=SleepRunner(0.005))
    engine = AsyncEngine.from_engine_core(core)
    with LiveServer(engine, ServerArgs(model_name="limits", stats_interval=0, **LIMITS)) as server:
        yield server
    engine.shutdown()


def raw(server, data: bytes, *, pause: float = 0.0, wait: float = 5.0) -> bytes:
    """Sends ``data`` (in one go, or byte by byte ``pause`` apart) and reads the answer
    until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait) as sock:
        try:
            if pause:
                for byte in data:
                    sock.sendall(bytes([byte]))
                    time.sleep(pause)
            else:
                sock.sendall(data)
        except OSError:
            pass  # the server may close before everything is sent; its answer is still there
        out = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not chunk:
                break
            out += chunk
        return out


def status_and_error(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return status, error


def still_serves(server) -> None:
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=10)
    assert ok.status_code == 200, ok.text


def head(path: str = "/v1/completions", extra: str = "") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{extra}".encode()


def test_a_large_content_length_is_413_before_the_body_is_read(served):
    started = time.monotonic()
    answer = raw(served, head(extra="Content-Length: 100000000\r\n\r\n") + b'{"prompt": [')
    assert time.monotonic() - started < 3  # not waiting for (or buffering) 100 MB
    status, error = status_and_error(answer)
    assert status == 413 and error["code"] == "request_too_large"
    still_serves(served)


def test_a_chunked_body_is_counted_and_refused_past_the_limit(served):
    chunk = b"x" * 1000
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(8)) + b"0\r\n\r\n"
    status, error = status_and_error(raw(served, head(extra="Transfer-Encoding: chunked\r\n\r\n") + body))
    assert status == 413 and error["code"] == "request_too_large"
    still_serves(served)


def test_a_large_head_is_431(served):
    big = "X-Filler: " + "a" * 20000 + "\r\n"
    status, error = status_and_error(raw(served, head(extra=big + "Content-Length: 2\r\n\r\n") + b"{}"))
    assert status == 431 and error["code"] == "headers_too_large"
    still_serves(served)


def test_a_slow_head_is_timed_out(served):
    started = time.monotonic()
    answer = raw(served, head(extra="X-Slow: yes\r\n") * 5, pause=0.02)
    status, error = status_and_error(answer)
    assert status == 408 and error["code"] == "header_timeout"
    assert time.monotonic() - started < 4
    # A connection that never sends anything is closed, silently.
    assert raw(served, b"") == b""


def test_a_slow_body_is_timed_out(served):
    answer = raw(served, head(extra="Content-Length: 100\r\n\r\n") + b'{"prompt": ')
    status, error = status_and_error(answer)
    assert status == 408 and error["code"] == "body_timeout"
    still_serves(served)


def test_past_the_concurrency_limit_a_request_is_503_with_retry_after(served):
    body = {"prompt": [1, 2], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", f"{served.url}/v1/completions", json=body) as first, \
                http.stream("POST", f"{served.url}/v1/completions", json=body) as second:
            assert first.status_code == 200 and second.status_code == 200
            refused = http.post(f"{served.url}/v1/completions", json={"prompt": [1], "max_tokens": 1})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "server_overloaded"
            assert http.get(f"{served.url}/health").status_code == 200  # monitoring is never refused
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # the streams' slots are freed as they end
        if httpx.post(f"{served.url}/v1/completions", json={"prompt": [1], "max_tokens": 1}).status_code == 200:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the concurrency slots were not released")


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": [[1], [2], [3], [4]], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b", "c", "d"], "max_tokens": 1}, "prompt"),
    ("/v1/embeddings", {"input": [[1], [2], [3], [4]]}, "input"),
])
def test_too_many_prompts_is_400(served, path, body, param):
    resp = httpx.post(f"{served.url}{path}", json=body, timeout=10)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param and resp.json()["error"]["code"] == "too_many_prompts"


def test_limit_flags_round_trip_with_defaults_from_server_args():
    parser = argparse.ArgumentParser()
    add_limit_flags(parser)
    defaults = ServerArgs(**limit_kwargs(parser.parse_args([])))
    assert defaults == ServerArgs()
    assert defaults.max_body_bytes == 16 * 1024 * 1024 and not defaults.enable_docs
    ns = parser.parse_args(["--max-body-bytes", "100", "--header-timeout", "2.5", "--enable-docs"])
    args = ServerArgs(**limit_kwargs(ns))
    assert (args.max_body_bytes, args.header_timeout, args.enable_docs) == (100, 2.5, True)


def _one_response(sock: socket.socket) -> bytes:
    """One whole response (head and Content-Length body): under load its head and body
    may arrive in separate reads, and the body must not be taken for the next response."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_a_body_arriving_after_an_early_response_is_not_counted_as_the_next_head():
    # A 404 is answered before its body is read; the body (larger than the head limit,
    # within the body limit) then arrives and the next request on the connection must be
    # served, not refused as an oversized head.
    core = EngineCore(EngineConfig(max_num_seqs=8), runner=SleepRunner(0.005))
    engine = AsyncEngine.from_engine_core(core)
    args = ServerArgs(model_name="limits", stats_interval=0, max_body_bytes=65536, max_header_bytes=4096)
    try:
        with LiveServer(engine, args) as server, socket.create_connection(("127.0.0.1", server.port),
                                                                           timeout=5) as sock:
            sock.sendall(b"POST /no-such-route HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 10000\r\n\r\n")
            first = _one_response(sock)
            assert first.startswith(b"HTTP/1.1 404"), first
            sock.sendall(b" " * 10000)
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            second = sock.recv(65536)
        assert second.startswith(b"HTTP/1.1 200"), second
    finally:
        engine.shutdown()
