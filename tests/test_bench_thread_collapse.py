"""The warning ``benches/tp.py`` and ``benches/serve_vs_offline.py`` print when a
2-thread engine collapsed on an oversubscribed host (TP=1 on 2 threads slower than on 1;
dp1 slower than half of dp2), naming the remedy the docs give; none when it did not."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))
import serve_vs_offline  # noqa: E402
import tp  # noqa: E402


def test_tp1_on_two_threads_slower_than_one_thread_is_a_warning():
    (warning,) = tp.threading_warnings(two_threads=37.0, one_thread=381.0)
    assert "TP=1 on 2 threads (37.0 tokens/s) was slower than on 1 thread (381.0)" in warning
    assert "OMP_WAIT_POLICY=PASSIVE" in warning
    assert tp.threading_warnings(two_threads=500.0, one_thread=381.0) == []


def test_dp1_slower_than_half_of_dp2_is_a_warning():
    runs = {"dp1": {"output_throughput": 30.0}, "dp2": {"output_throughput": 421.5}}
    (warning,) = serve_vs_offline.dp_warnings(runs)
    assert "dp1" in warning and "30.0 tok/s" in warning and "OMP_WAIT_POLICY=PASSIVE" in warning
    assert serve_vs_offline.dp_warnings({"dp1": {"output_throughput": 300.0},
                                         "dp2": {"output_throughput": 421.5}}) == []
    assert serve_vs_offline.dp_warnings({"dp2": {"output_throughput": 421.5}}) == []  # dp1 not run
