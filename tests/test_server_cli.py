"""``python -m pyengine serve MODEL ...`` as a user runs it: engine flags, JSON logs,
a request, and a clean exit on Ctrl-C. Loopback only, bounded waits."""

from __future__ import annotations

import json
import signal
import subprocess

import httpx
import pytest

from pyengine.server.cli import parse
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.serve_process import ServeProcess


def test_engine_flags_map_to_engine_config_fields():
    model, engine, args = parse(["/some/ckpt", "--port", "9001", "--max-num-seqs", "8", "--pipeline-depth", "1",
                                 "--dtype", "float32", "--no-enable-prefix-caching", "--max-model-len", "128",
                                 "--api-key", "k", "--stall-timeout", "5", "--log-format", "json"])
    assert model == "/some/ckpt"
    assert engine == {"max_num_seqs": 8, "pipeline_depth": 1, "dtype": "float32", "enable_prefix_caching": False,
                      "max_model_len": 128}
    assert (args.port, args.api_key, args.stall_timeout, args.log_format) == (9001, "k", 5.0, "json")
    assert args.model_name == "/some/ckpt"  # the model argument as given (vLLM's default)
    assert parse([])[0] is None and parse([])[2].model_name == "pyengine-tiny"


def test_flag_defaults_are_server_args_defaults():
    # One source of truth: every flag left unset gives ServerArgs' own default.
    import dataclasses

    from pyengine.server import ServerArgs

    _, engine, args = parse([])
    assert engine == {}
    for field in dataclasses.fields(ServerArgs):
        if field.name not in ("model_name", "model_aliases"):
            assert getattr(args, field.name) == field.default, field.name


def test_vllms_engine_flags_reach_the_engine_arguments():
    _, engine, _ = parse(["m", "--tensor-parallel-size", "2", "--generation-config", "vllm", "--tokenizer", "t",
                          "--dtype", "half", "--enforce-eager", "--trust-remote-code", "--revision", "v1"])
    assert engine == {"tensor_parallel_size": 2, "generation_config": "vllm", "tokenizer": "t", "dtype": "half",
                      "enforce_eager": True, "trust_remote_code": True, "revision": "v1"}


def test_bad_engine_flag_is_a_usage_error():
    from pyengine.server.cli import main

    assert main(["--pipeline-depth", "3"]) == 2
    with pytest.raises(SystemExit):
        main(["--no-such-flag"])


def test_serve_subprocess_answers_and_exits_on_ctrl_c(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")
    # The installed package (native module included) runs, not a source checkout. The wait
    # for /health is ServeProcess's: start-up took 14 s here on an idle machine and 39 s at
    # load 9, too close to the 60 s this test allowed of its own.
    server = ServeProcess([str(ckpt), "--max-num-seqs", "8", "--max-model-len", "256", "--num-kv-blocks", "64",
                           "--log-format", "json", "--stats-interval", "0", "--max-header-bytes", "4096",
                           "--max-body-bytes", "2048"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    proc = server.proc
    try:
        server.wait_up()
        resp = httpx.post(f"{server.url}/v1/completions", timeout=30,
                          json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
        # The limit flags reach the server the command builds.
        big_header = httpx.get(f"{server.url}/health", headers={"x-pad": "a" * 8192}, timeout=10)
        assert big_header.status_code == 431
        big_body = httpx.post(f"{server.url}/v1/completions", content=b"{" + b" " * 4096 + b"}",
                              headers={"content-type": "application/json"}, timeout=10)
        assert big_body.status_code == 413 and big_body.json()["error"]["message"]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        server.kill()
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    finished = [e for e in lines if e.get("event") == "request finished"]
    assert len(finished) == 1 and finished[0]["output_tokens"] == 3 and finished[0]["level"] == "info"


def test_a_failed_start_gives_the_caller_its_signal_handlers_back(monkeypatch):
    """main() runs inside other programs (tests among them): a start-up that fails must not
    leave its start-up SIGINT / SIGTERM handler installed in the caller's process."""
    from pyengine.entrypoints import client_factory
    from pyengine.errors import ModelLoadError
    from pyengine.server.cli import main

    def refuse(*args, **kwargs):
        raise ModelLoadError("no model here")

    monkeypatch.setattr(client_factory, "make_engine_client", refuse)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(ModelLoadError):
        main(["--load-format", "dummy"])
    assert {sig: signal.getsignal(sig) for sig in before} == before


class _BuiltEngine:
    def __init__(self) -> None:
        self.shut_down = False

    def shutdown(self, timeout: float = 10.0) -> None:
        self.shut_down = True


def test_a_signal_once_the_engine_is_built_shuts_it_down(monkeypatch):
    """A SIGTERM that lands after the engine is built but before the command ignores
    signals (its constructor's last line here) still ends the command with 128 + the
    signal, and the built engine is shut down, never left running."""
    import os

    from pyengine.entrypoints import client_factory
    from pyengine.server.cli import main

    built = _BuiltEngine()

    def build_then_signal(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # handled at once, by the command's start-up handler
        return built

    monkeypatch.setattr(client_factory, "make_engine_client", build_then_signal)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = main(["--load-format", "dummy"])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 128 + signal.SIGTERM
    assert built.shut_down, "the engine built before the signal was left running"
    assert {sig: signal.getsignal(sig) for sig in before} == before
