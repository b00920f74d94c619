"""What planning ahead buys: engine step time at pipeline depth 1 and 2.

The executor is synthetic (``SleepRunner``): each step takes ``--step-ms`` with the GIL
released, like a device running the forward pass. Scheduling (the Rust thread) and
output work (incremental detokenization on the output thread) are real. 256 requests
run together; per-step time is the wall time of the run divided by the steps.

Reported, for each depth: the step time, and each stage's time per step: the
scheduler thread's busy time, the executor's (its sleep plus the per-step Python around
it), the output thread's. Bar: at depth 2 the step takes at most 1.1x the largest
stage; depth 1 pays for the stages in turn.

    python benches/overlap.py [--json] [--step-ms 1] [--requests 256] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import logging
import time

from pyengine.config import EngineConfig
from pyengine.engine.core import EngineCore
from pyengine.sampling_params import SamplingParams
from pyengine.testing.synthetic_runner import SleepRunner


def run(depth: int, step_ms: float, requests: int, tokens: int) -> dict:
    from pyengine.entrypoints.llm import _BatchCollector

    config = EngineConfig(pipeline_depth=depth, max_num_seqs=requests, max_num_batched_tokens=max(8192, requests))
    core = EngineCore(config, runner=SleepRunner(step_ms / 1e3, max_rows=requests))
    try:
        collector = _BatchCollector()
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, stop=["\n\n"])  # real output work
        for i in range(requests):
            core.add_request(f"r{i}", None, [1 + i % 100, 2, 3, 4], params, collector, kind="final")
        # Admission step(s) first, then time the decode steps only.
        while core.executor.step_times.count < 2:
            time.sleep(0.001)
        steps0 = core.executor.step_times.count
        t0 = time.perf_counter()
        stats0 = core.stats()
        with collector.cond:
            while len(collector.results) < requests and collector.error is None:
                collector.cond.wait(0.5)
        elapsed = time.perf_counter() - t0
        stats = core.stats()
    finally:
        core.shutdown()
    steps = stats.steps - steps0

    def per_step(name: str) -> float:
        return 1e3 * (stats.threads[name]["busy_s"] - stats0.threads[name]["busy_s"]) / steps

    stages = {"scheduler": per_step("pyengine-sched"), "executor": per_step("pyengine-exec"),
              "output": per_step("pyengine-output")}
    step = 1e3 * elapsed / steps
    return {"depth": depth, "step_ms": round(step, 3), "steps": steps,
            "stage_ms": {k: round(v, 3) for k, v in stages.items()},
            "step_over_largest_stage": round(step / max(stages.values()), 3),
            "step_over_stage_sum": round(step / sum(stages.values()), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--step-ms", type=float, default=1.0)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    results = [run(depth, args.step_ms, args.requests, args.tokens) for depth in (1, 2)]
    if args.json:
        print(json.dumps({"depth1": results[0], "depth2": results[1]}))
        return
    for r in results:
        print(f"depth {r['depth']}: {r['step_ms']:.3f} ms/step over {r['steps']} steps; stages per step (ms): "
              f"{r['stage_ms']}; step / largest stage = {r['step_over_largest_stage']}, "
              f"step / sum of stages = {r['step_over_stage_sum']}")


if __name__ == "__main__":
    main()
