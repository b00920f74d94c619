"""``benches/throughput.py``'s transformers continuous-batching run: its paged cache is
sized to the workload (left to itself, transformers sizes it from the machine's memory),
every request gets exactly the tokens it asked for, and the engine's thread figures cover
the timed run alone (differences of two stats snapshots, never over 1 from start-up)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from pyengine.outputs import EngineStats
from pyengine.testing.checkpoints import make_tiny_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))
import throughput  # noqa: E402


def test_the_cache_holds_the_largest_requests_that_can_run_at_once():
    prompts = [[5] * 300, [5] * 10, [5] * 200, [5] * 600]
    outputs = [20, 20, 100, 20]
    config = throughput.hf_cache_config(prompts, outputs, max_num_seqs=2)
    # Blocks of 256 tokens per request: 2, 1, 2, 3; the two largest at once: 3 + 2.
    assert config.num_blocks == 5
    assert config.max_requests_per_batch == 2
    assert config.max_batch_tokens == 1024  # the longest prompt (600) fits in one batch
    assert throughput.hf_cache_config([[5] * 2000], [8], 4).max_batch_tokens == 2000


def test_continuous_batching_generates_every_asked_token(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "qwen3")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, n).tolist() for n in (5, 17, 9, 30)]
    outputs = [3, 7, 3, 7]
    # The bench asserts the generated tokens equal the asked ones; its rate is positive.
    assert throughput.run_hf_generate_batch(folder, prompts, outputs, max_num_seqs=2, timeout=120.0) > 0


def _stats(steps: int, busy: dict[str, float]) -> EngineStats:
    return EngineStats(threads={name: {"busy_s": b, "idle_s": 0.0} for name, b in busy.items()}, steps=steps,
                       step_time_mean_ms=2.5, step_time_p99_ms=3.0, num_running=0, num_waiting=0,
                       num_preempted_waiting=0, preemptions=0, kv_usage=0.0, kv_blocks_total=8,
                       prefix_cache_hit_rate=0.0, prompt_tokens=0, generated_tokens=0, queue_depths={})


def test_thread_figures_cover_the_timed_run_only():
    before = _stats(3, {"pyengine-exec": 4.0, "pyengine-sched": 0.5})  # start-up and warm-up
    after = _stats(43, {"pyengine-exec": 13.0, "pyengine-sched": 1.5})
    figures = throughput.timed_stats(before, after, elapsed=10.0)
    assert figures["thread_busy_fraction"] == {"pyengine-exec": 0.9, "pyengine-sched": 0.1}
    assert figures["steps"] == 40
