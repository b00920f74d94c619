"""``pyengine serve`` ends through ``os._exit`` after a complete shutdown (as the engine
core and TP workers do): the in-process server (``--no-multiprocess``, where torch, and
through transformers triton, are loaded) exits 0 on Ctrl-C with its last log lines
flushed and without the interpreter's teardown report ("nanobind: leaked ..."); other
commands, and ``main`` called inside another program, keep the ordinary exit."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.serve_process import ServeProcess


def test_the_in_process_server_exits_0_with_its_logs_and_no_teardown_report(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path / "qwen3")
    server = ServeProcess([str(checkpoint), "--no-multiprocess", "--log-format", "json", "--log-level", "info",
                           "--stats-interval", "0", "--max-num-seqs", "4", "--num-kv-blocks", "64"],
                          stderr=subprocess.PIPE, text=True)
    try:
        server.wait_up()
        resp = httpx.post(f"{server.url}/v1/completions", json={"prompt": [11, 12, 13], "max_tokens": 3}, timeout=60)
        assert resp.status_code == 200
        assert server.stop() == 0
        err = server.proc.stderr.read()
    finally:
        server.kill()
    assert "nanobind" not in err and "leaked" not in err, err[-2000:]
    events = [json.loads(line).get("event") for line in err.splitlines() if line.startswith("{")]
    assert events[-2:] == ["server stopped", "engine shut down"], events  # flushed before os._exit


def test_other_commands_exit_through_sys_exit(monkeypatch, capsys):
    from pyengine.cli.main import run

    monkeypatch.setattr(sys, "argv", ["pyengine", "--version"])
    with pytest.raises(SystemExit) as leaving:
        run()
    assert leaving.value.code == 0 and capsys.readouterr().out.startswith("pyengine ")
