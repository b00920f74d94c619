"""Graceful shutdown of ``pyengine serve``: SIGTERM and SIGINT with streams in flight.

The server must stop taking requests, let the streams run up to ``--drain-timeout``, end
the rest with an error event and ``[DONE]``, shut the engine down, flush its logs and exit
0 within seconds; SIGINT must not print a traceback per request. Loopback only; every
wait is bounded and the child is always reaped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Optional

import httpx
import pytest

from pyengine.server.cli import parse
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.serve_process import ServeProcess
from pyengine.testing.waits import wait_until

N_STREAMS = 6


class Stream(threading.Thread):
    """One streaming completion, read to its end; records its ``data:`` payloads."""

    def __init__(self, port: int, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.port, self.max_tokens = port, max_tokens
        self.data: list[str] = []
        self.started = threading.Event()
        self.failure: Optional[BaseException] = None

    def run(self) -> None:
        body = {"prompt": "Hello", "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream": True}
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{self.port}/v1/completions", json=body,
                              timeout=60) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        self.data.append(line[6:])
                        self.started.set()
        except BaseException as error:  # noqa: BLE001 - reported by the test
            self.failure = error
        finally:
            self.started.set()

    def outcome(self) -> str:
        """"done" (completed), "ended" (error event, then [DONE]); anything else fails."""
        assert self.failure is None, repr(self.failure)
        assert self.data and self.data[-1] == "[DONE]", self.data[-3:]
        last = json.loads(self.data[-2])
        if "error" in last:
            assert last["error"]["code"] == "server_shutting_down", last
            return "ended"
        assert last["choices"][0]["finish_reason"] == "length", last
        return "done"


class Blocking(threading.Thread):
    """One non-streaming completion; records its status and body."""

    def __init__(self, port: int, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.port, self.max_tokens = port, max_tokens
        self.status, self.body = 0, {}

    def run(self) -> None:
        resp = httpx.post(f"http://127.0.0.1:{self.port}/v1/completions", timeout=60,
                          json={"prompt": "Hello", "max_tokens": self.max_tokens,
                                "ignore_eos": True})
        self.status, self.body = resp.status_code, resp.json()


def serve(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen[str], int]:
    ckpt = tmp_path / "ckpt"
    if not ckpt.exists():
        make_tiny_checkpoint(ckpt)
    # The installed package (native module included) is the one served, not a source checkout.
    server = ServeProcess([str(ckpt), "--max-num-seqs", "16", "--max-model-len", "4096", "--stats-interval", "0",
                           *flags], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        server.wait_up()
    except BaseException:
        server.kill()
        raise
    return server.proc, server.port


def draining(port: int) -> bool:
    """Whether the server has begun its drain: /health is refused (503) or the listener closed."""
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code != 200
    except httpx.TransportError:
        return True


def refused_during_drain(port: int) -> bool:
    """A new request during the drain: the listener is closed, or a 503 in OpenAI's format."""
    try:
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=5,
                          json={"prompt": "Hi", "max_tokens": 2})
    except httpx.TransportError:
        return True
    return resp.status_code == 503 and resp.json()["error"]["code"] == "server_shutting_down"


def start_streams(port: int, max_tokens: list[int]) -> list[Stream]:
    streams = [Stream(port, n) for n in max_tokens]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(30)
    return streams


def reap(proc: subprocess.Popen[str], streams: list[Stream], sent: float) -> dict[str, Any]:
    _, err = proc.communicate(timeout=30)
    exit_s = time.monotonic() - sent
    for s in streams:
        s.join(10)
    return {"rc": proc.returncode, "exit_s": exit_s, "err": err, "outcomes": [s.outcome() for s in streams]}


def stop(tmp_path: Path, sig: int, max_tokens: list[int], *flags: str, again: bool = False) -> dict[str, Any]:
    """Serves, starts a long non-streaming request and one stream per ``max_tokens``, sends
    ``sig`` once they all run (and once more if ``again``), checks that a new request is
    refused, and reaps the server."""
    proc, port = serve(tmp_path, *flags)
    try:
        blocking = Blocking(port, 4000)
        blocking.start()
        streams = start_streams(port, max_tokens)
        sent = time.monotonic()
        proc.send_signal(sig)
        # The signal is handled on the server's event loop: wait for the drain, not a fixed time.
        assert wait_until(lambda: draining(port), 30, interval=0.02), "the signal did not start the drain"
        refused = refused_during_drain(port)
        if again:
            proc.send_signal(sig)
        got = reap(proc, streams, sent)
        blocking.join(10)
        return {**got, "refused": refused, "blocking": (blocking.status, blocking.body)}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


def json_events(err: str) -> list[str]:
    return [json.loads(line)["event"] for line in err.splitlines() if line.startswith("{")]


def test_drain_timeout_flag():
    assert parse([])[2].drain_timeout == 30.0
    assert parse(["--drain-timeout", "0"])[2].drain_timeout == 0.0
    from pyengine.server.cli import main

    assert main(["--drain-timeout", "-1"]) == 2


def test_sigterm_finishes_short_streams_ends_long_ones_and_exits_0(tmp_path):
    got = stop(tmp_path, signal.SIGTERM, [200] * 3 + [4000] * 3, "--drain-timeout", "4", "--log-format", "json")
    assert got["rc"] == 0, got["err"][-3000:]
    assert got["exit_s"] < 4 + 5, got["exit_s"]
    assert got["refused"]
    assert got["outcomes"] == ["done"] * 3 + ["ended"] * 3
    status, body = got["blocking"]  # not begun when the drain ended: a 503 in OpenAI's format
    assert status == 503 and body["error"]["code"] == "server_shutting_down", got["blocking"]
    events = json_events(got["err"])
    assert "draining" in events and events[-1] == "engine shut down", events


@pytest.mark.parametrize("drain_timeout, again", [("0", False), ("30", True)])
def test_sigint_exits_fast_without_a_traceback_storm(tmp_path, drain_timeout, again):
    """Console logs (whose pretty printer took 117 s for 64 tracebacks). With a long drain,
    a second SIGINT ends it at once."""
    got = stop(tmp_path, signal.SIGINT, [4000] * N_STREAMS, "--drain-timeout", drain_timeout,
               "--log-format", "console", again=again)
    assert got["rc"] == 0, got["err"][-3000:]
    assert got["exit_s"] < 5, got["exit_s"]
    assert got["refused"]
    assert got["outcomes"] == ["ended"] * N_STREAMS
    assert "Traceback" not in got["err"] and "Exception in ASGI" not in got["err"], got["err"][-3000:]
    assert "engine shut down" in got["err"].splitlines()[-1], got["err"][-1000:]
