"""Scheduler cost per step through the Python binding.

The same workloads as the criterion benches (`cargo bench --bench scheduler`), driven
with exactly the calls the engine makes each step: the executor takes a plan and hands
back sampled ids, the output thread takes the event. The difference from the Rust
figures is the cost of crossing the boundary.

    python benches/sched_step.py            # table
    python benches/sched_step.py --json     # one JSON object per line
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from pyengine import Request, Scheduler, SchedulerConfig

PROMPT_LEN = 512
BLOCK_SIZE = 16


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _step(sched: Scheduler, sampled_by_count: dict[int, np.ndarray]) -> int:
    """One step as the engine makes it; returns how many sequences sampled."""
    plan = sched.schedule()
    assert plan is not None
    n = plan.num_samples
    sampled = sampled_by_count.get(n)
    if sampled is None:
        sampled = sampled_by_count.setdefault(n, np.full(n, 7, dtype=np.int64))
    sched.apply_result(plan.step_id, sampled)
    sched.take_output(plan.step_id)
    return n


def decode_step(n: int, steps: int, warmup: int) -> list[float]:
    """µs per steady-state decode step with `n` running requests of 512-token prompts."""
    budget = max(8192, n)
    # Early requests decode while later ones prefill: leave room so none finishes.
    max_tokens = 3 * n * PROMPT_LEN // budget + warmup + steps + 16
    blocks_per_seq = (PROMPT_LEN + max_tokens) // BLOCK_SIZE + 1
    sched = Scheduler(
        SchedulerConfig(
            n * blocks_per_seq,
            block_size=BLOCK_SIZE,
            max_num_seqs=n,
            max_num_batched_tokens=budget,
            max_model_len=PROMPT_LEN + max_tokens,
            pipeline_depth=1,
        )
    )
    rng = np.random.default_rng(n)
    for i in range(n):
        prompt = rng.integers(0, 32000, PROMPT_LEN).tolist()
        sched.add_request(Request(f"r{i}", prompt, max_tokens=max_tokens, ignore_eos=True))
    cache: dict[int, np.ndarray] = {}
    while _step(sched, cache) < n:  # prefill everything first
        pass
    for _ in range(warmup):
        _step(sched, cache)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        _step(sched, cache)
        times.append((time.perf_counter() - t0) * 1e6)
    stats = sched.stats()
    assert stats["num_running"] == n and stats["preemptions"] == 0, stats
    return times


def prefill_burst(n: int = 256, prompt_len: int = 2048, budget: int = 8192) -> list[float]:
    """µs per step while `n` prompts of `prompt_len` tokens are prefilled."""
    max_tokens = n * prompt_len // budget + 16  # none finishes before the last prompt is in
    sched = Scheduler(
        SchedulerConfig(
            n * ((prompt_len + max_tokens) // BLOCK_SIZE + 1),
            block_size=BLOCK_SIZE,
            max_num_seqs=n,
            max_num_batched_tokens=budget,
            max_model_len=prompt_len + max_tokens,
            pipeline_depth=1,
        )
    )
    rng = np.random.default_rng(0)
    for i in range(n):
        prompt = rng.integers(0, 32000, prompt_len).tolist()
        sched.add_request(Request(f"p{i}", prompt, max_tokens=max_tokens, ignore_eos=True))
    cache: dict[int, np.ndarray] = {}
    times = []
    sampled = 0
    while sampled < n:  # until every prompt is in (early ones decode meanwhile)
        t0 = time.perf_counter()
        sampled = _step(sched, cache)
        times.append((time.perf_counter() - t0) * 1e6)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--sizes", default="64,256,1024,4096")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        times = decode_step(n, args.steps, warmup=20)
        rows.append({"bench": "decode_step", "n": n, "us_per_step": statistics.median(times),
                     "p90": _percentile(times, 0.9), "us_per_request": statistics.median(times) / n})
    times = prefill_burst()
    rows.append({"bench": "prefill_burst", "n": 256, "prompt_len": 2048, "budget": 8192,
                 "us_per_step": statistics.median(times), "p90": _percentile(times, 0.9)})
    for row in rows:
        if args.json:
            print(json.dumps(row))
        else:
            extra = f"  ({row['us_per_request']:.3f} µs/request)" if "us_per_request" in row else ""
            print(f"{row['bench']:>14} n={row['n']:>5}: median {row['us_per_step']:9.1f} µs/step, "
                  f"p90 {row['p90']:9.1f}{extra}")


if __name__ == "__main__":
    main()
