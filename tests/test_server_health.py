"""``/health`` reflects real progress (a hung executor turns it 503, with one thread dump
in the logs, and it recovers), and ``/metrics`` parses as Prometheus text and counts what
was served."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from pyengine import AsyncEngine
from pyengine.server import ServerArgs
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.faults import install_faulty_runner
from pyengine.testing.live_server import LiveServer

MODEL = "tiny-health"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    engine = AsyncEngine(path, max_num_seqs=16, max_model_len=256, num_kv_blocks=256)
    args = ServerArgs(model_name=MODEL, stall_timeout=0.5, watchdog_interval=0.1, stats_interval=0.2)
    with LiveServer(engine, args) as server:
        yield server, engine
    engine.shutdown()


def health(server) -> httpx.Response:
    return httpx.get(f"{server.url}/health", timeout=10)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_health_turns_503_while_the_executor_hangs_and_recovers(served):
    server, engine = served
    faults = install_faulty_runner(engine.engine_core)
    assert health(server).status_code == 200
    watchdog = server.app.state.watchdog
    dumps = watchdog.dumps
    result: dict = {}

    def request():
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
        result["resp"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)

    with structlog.testing.capture_logs() as logs:
        faults.hang.set()
        caller = threading.Thread(target=request)
        try:
            caller.start()
            wait_for(lambda: health(server).status_code == 503, 10, "/health to turn 503")
            body = health(server).json()
            assert body["status"] == "stalled" and body["pending_requests"] == 1
            wait_for(lambda: watchdog.dumps == dumps + 1, 5, "the watchdog's dump")
            time.sleep(0.3)  # still stalled: no second dump
            assert watchdog.dumps == dumps + 1
        finally:
            faults.hang.clear()
        caller.join(timeout=20)
        wait_for(lambda: health(server).status_code == 200, 10, "/health to recover")
        wait_for(lambda: any(e["event"] == "engine healthy again" for e in logs), 5, "the recovery log line")
    assert result["resp"].status_code == 200
    dump = next(e for e in logs if e["event"] == "engine unhealthy")
    assert dump["stuck_thread"].startswith("pyengine-exec")
    exec_part, rest = dump["stack"].split("--- pyengine-output", 1)
    assert exec_part.startswith("--- pyengine-exec") and "in _step" in exec_part  # the stuck step's stack
    assert "in run" in rest and "--- pyengine-sched (native" in rest
    sched = dump["pyengine-sched"]
    assert sched["native"] and "queue_depths" in sched and "busy_s" in sched


def test_request_and_stats_log_lines(served):
    server, _ = served
    with structlog.testing.capture_logs() as logs:
        resp = httpx.post(f"{server.url}/v1/completions", json={"prompt": [9, 9], "max_tokens": 30,
                                                                 "ignore_eos": True}, timeout=30)
        assert resp.status_code == 200
        wait_for(lambda: any(e["event"] == "engine stats" for e in logs), 5, "a stats line")
    line = next(e for e in logs if e["event"] == "request finished")
    assert line["request_id"] == resp.json()["id"]
    assert line["prompt_tokens"] == 2 and line["output_tokens"] == 30 and line["finish_reason"] == "length"
    assert line["ttft_s"] is not None and line["e2e_s"] >= line["ttft_s"]


def scrape(server) -> dict[str, dict]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f"|{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            out.setdefault(family.name, {})[key] = sample.value
    return out


def total(metrics: dict[str, dict], family: str, sample: str) -> float:
    return sum(v for k, v in metrics.get(family, {}).items() if k.split("|")[0] == sample)


def test_metrics_parse_and_count_what_was_served(served):
    server, engine = served
    before = scrape(server)
    n, tokens = 5, 7
    for i in range(n):
        resp = httpx.post(f"{server.url}/v1/completions", json={"prompt": [10 + i, 11, 12], "max_tokens": tokens,
                                                                 "ignore_eos": True}, timeout=30)
        assert resp.status_code == 200
    bad = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 0}, timeout=10)
    assert bad.status_code == 400
    after = scrape(server)

    def delta(family: str, sample: str) -> float:
        return total(after, family, sample) - total(before, family, sample)

    assert delta("pyengine:request_success", "pyengine:request_success_total") == n
    assert after["pyengine:request_success"]
    assert any("finished_reason=length" in k for k in after["pyengine:request_success"])
    assert delta("pyengine:generation_tokens", "pyengine:generation_tokens_total") >= n * tokens
    assert delta("pyengine:prompt_tokens", "pyengine:prompt_tokens_total") == 3 * n
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert delta(f"pyengine:{hist}", f"pyengine:{hist}_count") == n, hist
    assert delta("pyengine:inter_token_latency_seconds", "pyengine:inter_token_latency_seconds_count") >= n
    assert delta("pyengine:http_request_errors", "pyengine:http_request_errors_total") == 1
    threads = {k.split("thread=")[1] for k in after["pyengine:thread_busy_seconds"]}
    assert threads == {"pyengine-sched", "pyengine-exec", "pyengine-output"}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "step_time_mean_seconds"):
        assert f"pyengine:{name}" in after, name
    for name in ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "pipeline_bubble_seconds",
                 "engine_steps"):
        assert f"pyengine:{name}" in after, name
    assert delta("pyengine:engine_steps", "pyengine:engine_steps_total") >= tokens
