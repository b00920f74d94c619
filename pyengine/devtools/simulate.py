"""A scheduler simulation: the real scheduler thread and channels, a fake executor.

This is what ``pyengine simulate`` runs: a random workload goes through
``pyengine-sched`` exactly as the engine drives it, and the per-step scheduling cost is
printed, with no model in the way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from pyengine._sched import Request, SchedulerConfig, SchedulerThread
from pyengine.devtools.fake_executor import FakeExecutor, drive


@dataclass(frozen=True)
class SimulationConfig:
    num_requests: int = 2000
    min_prompt: int = 32
    max_prompt: int = 1024
    min_output: int = 16
    max_output: int = 256
    shared_prefix: int = 256
    num_blocks: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    pipeline_depth: int = 2
    seed: int = 0


def workload(cfg: SimulationConfig) -> list[Request]:
    """Random prompts, half of them behind a common system prompt (prefix-cache hits)."""
    rng = np.random.default_rng(cfg.seed)
    system = rng.integers(0, 32000, cfg.shared_prefix).tolist()
    reqs = []
    for i in range(cfg.num_requests):
        body = rng.integers(0, 32000, int(rng.integers(cfg.min_prompt, cfg.max_prompt + 1))).tolist()
        prompt = (system + body) if i % 2 == 0 else body
        reqs.append(Request(f"sim-{i}", prompt, max_tokens=int(rng.integers(cfg.min_output, cfg.max_output + 1)),
                            ignore_eos=True))
    return reqs


def run(cfg: SimulationConfig) -> dict[str, float]:
    """Runs the workload to completion; returns the scheduler's figures."""
    sched = SchedulerThread(
        SchedulerConfig(
            cfg.num_blocks,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.shared_prefix + cfg.max_prompt + cfg.max_output,
            pipeline_depth=cfg.pipeline_depth,
        )
    )
    try:
        started = time.perf_counter()
        result = drive(sched, workload(cfg), FakeExecutor(vocab=32000))
        elapsed = time.perf_counter() - started
        stats = dict(sched.stats())
    finally:
        sched.shutdown()
    generated = sum(len(t) for outs in result.tokens.values() for t in outs)
    stats.update(wall_seconds=elapsed, simulated_tokens_per_second=generated / elapsed)
    return stats


def report(stats: dict[str, float]) -> str:
    queried = max(1, int(stats["prefix_cache_queried_tokens"]))
    lines = [
        f"steps planned          {stats['steps_planned']}",
        f"plan time per step     mean {stats['plan_us_mean']:.1f} µs, max {stats['plan_us_max']:.1f} µs",
        f"scheduler thread       busy {stats['sched_busy_seconds']:.3f} s, idle {stats['sched_idle_seconds']:.3f} s",
        f"tokens                 {stats['prefill_tokens_scheduled']} prefill, {stats['generated_tokens']} generated",
        f"prefix cache hit rate  {stats['prefix_cache_hit_tokens'] / queried:.1%}",
        f"preemptions            {stats['preemptions']}",
        f"KV blocks in use       {stats['kv_blocks_used']} of {stats['kv_blocks_total']} (all free again)"
        if stats["kv_blocks_used"] == 0 else f"KV blocks in use       {stats['kv_blocks_used']} (LEAK)",
        f"wall time              {stats['wall_seconds']:.2f} s with a fake executor "
        f"({stats['simulated_tokens_per_second']:.0f} tokens/s of scheduling throughput)",
    ]
    return "\n".join(lines)
