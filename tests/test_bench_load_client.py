"""The serving benchmarks' lean HTTP client (``benches/sse_client.py``) against a real
server: streamed completions counted as httpx counts them, connections kept alive and
reused, an error status reported (not raised), a stream left early closes its connection
and the server aborts the request."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import pytest

from pyengine import AsyncEngine
from pyengine.server import ServerArgs
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.live_server import LiveServer
from pyengine.testing.waits import wait_engine_idle

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))
import serve  # noqa: E402
from sse_client import Connection, ConnectionPool, HTTPStatusError  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    engine = AsyncEngine(path, max_num_seqs=16, max_model_len=256)
    with LiveServer(engine, ServerArgs(stats_interval=0, log_requests=False)) as server:
        yield server, engine
    engine.shutdown()


def _load(client: str) -> argparse.Namespace:
    return argparse.Namespace(num_prompts=6, request_rate=float("inf"), max_concurrency=3, input_len=8,
                              output_len=5, range_ratio=0.0, vocab=200, min_token_id=3, warmup=1, timeout=60.0,
                              seed=0, model=None, client=client)


@pytest.mark.parametrize("client", ["lean", "httpx"])
def test_both_clients_count_every_streamed_token(served, client):
    server, _ = served
    report = asyncio.run(serve.run(_load(client), server.url))
    assert report["completed"] == 6 and report["failed"] == 0
    assert report["total_output_tokens"] == 6 * 5
    assert report["mean_ttft_ms"] > 0 and report["mean_itl_ms"] > 0


def test_connections_are_kept_alive_and_reused(served):
    server, _ = served

    async def go() -> int:
        pool = ConnectionPool(server.url)
        try:
            for _ in range(4):
                result = await serve.one_request(pool, server.url, None, [5, 6, 7], 3, 30.0)
                assert result.ok and result.output_tokens == 3
            return pool.opened
        finally:
            pool.close()

    assert asyncio.run(go()) == 1


def test_an_error_status_is_reported_and_the_next_request_works(served):
    server, _ = served

    async def go() -> tuple[serve.Result, serve.Result]:
        pool = ConnectionPool(server.url)
        try:
            bad = await serve.one_request(pool, server.url, None, [10 ** 6], 3, 30.0)  # beyond the vocabulary
            good = await serve.one_request(pool, server.url, None, [5, 6, 7], 3, 30.0)
            return bad, good
        finally:
            pool.close()

    bad, good = asyncio.run(go())
    assert not bad.ok and bad.error.startswith("HTTP 400")
    assert good.ok and good.output_tokens == 3


def test_a_stream_left_early_closes_its_connection_and_the_server_aborts(served):
    server, engine = served

    async def go() -> None:
        connection = Connection(server.url)
        body = b'{"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": true, "stream": true}'
        events = connection.stream_events("/v1/completions", body)
        async for _ in events:
            break  # one chunk, then the consumer leaves
        await events.aclose()
        assert connection._writer is None  # not clean: closed, never reused half-read

    asyncio.run(go())
    assert wait_engine_idle(engine), "the server did not abort the stream its client left"


def test_a_refused_status_raises_from_the_raw_stream(served):
    server, _ = served

    async def go() -> None:
        connection = Connection(server.url)
        with pytest.raises(HTTPStatusError) as raised:
            async for _ in connection.stream_events("/v1/completions", b'{"prompt": "x", "max_tokens": -1}'):
                pass
        assert raised.value.status == 400

    asyncio.run(go())


class _Py310Timeout(Exception):
    """Python 3.10's ``asyncio.TimeoutError``: not the builtin ``TimeoutError``."""


def test_a_request_past_its_timeout_is_a_failed_result_on_python_310_too(served, monkeypatch):
    server, _ = served
    real_wait_for = asyncio.wait_for

    async def wait_for_as_on_310(awaitable, timeout):
        try:
            return await real_wait_for(awaitable, timeout)
        except TimeoutError:
            raise _Py310Timeout() from None

    monkeypatch.setattr(asyncio, "TimeoutError", _Py310Timeout)
    monkeypatch.setattr(asyncio, "wait_for", wait_for_as_on_310)

    async def go() -> serve.Result:
        pool = ConnectionPool(server.url)
        try:
            return await serve.one_request(pool, server.url, None, [5, 6, 7], 200, 0.02)
        finally:
            pool.close()

    result = asyncio.run(go())
    assert not result.ok and "_Py310Timeout" in result.error


def test_json_report_is_strict_json_at_the_default_rate(served, capsys):
    server, _ = served

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    code = serve.main(["--url", server.url, "--json", "--num-prompts", "2", "--input-len", "8", "--output-len", "3",
                       "--warmup", "0", "--vocab", "200"])
    report = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert code == 0 and report["completed"] == 2
    assert report["request_rate"] is None  # the default: every request at once
