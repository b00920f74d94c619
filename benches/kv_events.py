"""What KV-cache events cost the scheduler: the same workloads with events off and on,
alternated in one run, through the Python binding with the calls the engine makes each
step (plan, result, take the output event: on, the event carries the step's log as numpy
arrays). Also the publisher thread's own cost per stored block (building vLLM's Structs
and encoding them), which runs off the engine's three threads.

    python benches/kv_events.py            # table
    python benches/kv_events.py --json     # one JSON object per line
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import msgspec
import numpy as np

from pyengine import Request, Scheduler, SchedulerConfig
from pyengine.kv_events.wire import KVEventBatch, events_from_log

BLOCK_SIZE = 16


def run(workload: str, events: bool) -> tuple[float, int, int, list]:
    """Seconds for the whole workload, steps, events logged, and the logs (kept for the
    encode bench)."""
    if workload == "prefill":  # every prompt block is stored once; nothing is evicted
        n, prompt_len, max_tokens, num_blocks = 128, 1024, 2, None
    else:  # "churn": a pool of 512 blocks, 512 distinct prompts: each admission evicts
        n, prompt_len, max_tokens, num_blocks = 512, 512, 1, 512
    blocks = num_blocks or n * ((prompt_len + max_tokens) // BLOCK_SIZE + 1)
    sched = Scheduler(SchedulerConfig(blocks, block_size=BLOCK_SIZE, max_num_seqs=64, max_num_batched_tokens=8192,
                                      max_model_len=prompt_len + max_tokens, pipeline_depth=1,
                                      enable_kv_events=events))
    rng = np.random.default_rng(0)
    for i in range(n):
        sched.add_request(Request(f"r{i}", rng.integers(0, 32000, prompt_len).tolist(), max_tokens=max_tokens,
                                  ignore_eos=True))
    logs, logged, steps = [], 0, 0
    t0 = time.perf_counter()
    while True:
        plan = sched.schedule()
        if plan is None:
            break
        sched.apply_result(plan.step_id, np.full(plan.num_samples, 7, dtype=np.int64))
        ev = sched.take_output(plan.step_id)
        steps += 1
        if ev.kv_events is not None:
            logs.append(ev.kv_events)
            logged += len(ev.kv_events[0])
    elapsed = time.perf_counter() - t0
    assert not sched.has_unfinished()
    return elapsed, steps, logged, logs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for workload in ("prefill", "churn"):
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for events in (False, True):  # alternated: the machine's noise hits both alike
                elapsed, steps, logged, logs = run(workload, events)
                times[events].append(elapsed / steps * 1e6)
        off, on = statistics.median(times[False]), statistics.median(times[True])
        encoder = msgspec.msgpack.Encoder()
        t0 = time.perf_counter()
        for log in logs:
            encoder.encode(KVEventBatch(0.0, events_from_log(log, BLOCK_SIZE, "CPU"), 0))
        encode_us = (time.perf_counter() - t0) * 1e6 / max(1, logged)
        rows.append({"bench": "kv_events", "workload": workload, "steps": steps, "events": logged,
                     "us_per_step_off": off, "us_per_step_on": on, "on_over_off": on / off,
                     "publisher_us_per_event": encode_us})
    for row in rows:
        if args.json:
            print(json.dumps(row))
        else:
            print(f"{row['workload']:>8}: {row['steps']} steps, {row['events']} events; µs/step off "
                  f"{row['us_per_step_off']:.1f}, on {row['us_per_step_on']:.1f} (x{row['on_over_off']:.3f}); "
                  f"publisher {row['publisher_us_per_event']:.2f} µs/event")


if __name__ == "__main__":
    main()
