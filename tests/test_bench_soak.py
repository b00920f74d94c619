"""``benches/soak.py`` against a real multi-process ``pyengine serve``: the front end and
its engine core are measured separately and summed (the core holds the model, so a
figure of the front end alone would miss a leak there), and a run stopped before a mark
reports null for it, skips the growth check with a message, and is strict JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import pytest

from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.serve_process import ServeProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))
import soak  # noqa: E402


def _args(num_requests: int, max_seconds: float) -> argparse.Namespace:
    return argparse.Namespace(seed=0, warmup=2, num_requests=num_requests, max_seconds=max_seconds, concurrency=4,
                              timeout=60.0, max_prompt_len=16, max_output_len=2, vocab=200, min_token_id=3,
                              trail_every=5)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("soak") / "llama")
    with ServeProcess([str(checkpoint), "--stats-interval", "0", "--log-level", "warning",
                       "--no-log-requests"]) as running:
        yield running.wait_up()


def test_the_front_end_and_each_engine_core_are_measured_and_summed(server):
    report = asyncio.run(soak.soak(_args(10, 120.0), server.url, server.pid))
    assert report["completed"] == 10 and report["failed"] == 0 and not report["timed_out"]
    assert report["processes"] == {"front_end": server.pid, "core_0": server.core_pids()[0]}
    for column in ("rss_start_mb", "rss_after_warmup_mb", "rss_at_1k_mb", "rss_end_mb"):
        figures = report[column]
        assert set(figures) == {"front_end", "core_0", "total"}
        assert figures["front_end"] > 0 and figures["core_0"] > 0
        assert figures["total"] == pytest.approx(figures["front_end"] + figures["core_0"], abs=0.11)
    assert report["growth_1k_to_end_mb"]["total"] == pytest.approx(
        report["rss_end_mb"]["total"] - report["rss_at_1k_mb"]["total"], abs=0.11)
    assert [n for n, _ in report["rss_trail_mb"]] == [5, 10]
    table = soak.format_report(report)
    (core_line,) = [line.split() for line in table.splitlines() if line.strip().startswith("core_0")]
    assert core_line[:2] == ["core_0", str(report["processes"]["core_0"])]
    assert float(core_line[5]) == report["rss_end_mb"]["core_0"]


def test_a_bar_over_the_sum_fails_with_its_reason(capsys):
    report = {"completed": 2000, "failed": 0,
              "growth_1k_to_end_mb": {"front_end": 30.0, "core_0": 30.0, "total": 60.0}}
    assert not soak.check_bar(report)
    assert "RSS grew 60.0 MB" in capsys.readouterr().err


def test_a_run_stopped_before_its_marks_reports_null_and_skips_the_check(server, capsys):
    report = asyncio.run(soak.soak(_args(3000, 0.0), server.url, server.pid))
    assert report["timed_out"] and report["completed"] == 0
    assert report["rss_after_warmup_mb"] is None and report["rss_at_1k_mb"] is None
    assert report["growth_1k_to_end_mb"] is None
    assert report["rss_end_mb"]["total"] > 0  # the end is sampled when the run stops
    assert json.loads(json.dumps(report, allow_nan=False))["rss_at_1k_mb"] is None
    assert soak.check_bar(report)
    assert "not checked" in capsys.readouterr().err
    assert "        -" in soak.format_report(report)
