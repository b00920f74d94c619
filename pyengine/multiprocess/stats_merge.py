"""One ``EngineStats`` for several engine cores (``EngineClient.stats`` of a front end with
``data_parallel_size > 1``); ``/metrics`` shows each core's own as well."""

from __future__ import annotations

from typing import Union

from pyengine.outputs import EngineStats


def merge_stats(parts: list[EngineStats]) -> EngineStats:
    """Counts and seconds add up; step times are weighted by steps (the p99 is the worst
    core's), KV usage by each core's pool, the prefix-cache hit rate by prompt tokens."""
    if len(parts) == 1:
        return parts[0]
    steps = sum(p.steps for p in parts)
    blocks = sum(p.kv_blocks_total for p in parts)
    prompts = sum(p.prompt_tokens for p in parts)
    threads: dict[str, dict[str, float]] = {}
    for p in parts:
        for name, figures in p.threads.items():
            into = threads.setdefault(name, {})
            for key, value in figures.items():
                into[key] = into.get(key, 0.0) + value
    queues: dict[str, int] = {}
    scheduler: dict[str, Union[float, list[float]]] = {}
    for p in parts:
        for key, n in p.queue_depths.items():
            queues[key] = queues.get(key, 0) + n
        for key, value in p.scheduler.items():
            if isinstance(value, list):  # per position: added position by position
                into = list(scheduler.get(key, []))  # type: ignore[arg-type]
                into += [0.0] * (len(value) - len(into))
                scheduler[key] = [a + b for a, b in zip(into, value + [0.0] * (len(into) - len(value)))]
            else:
                scheduler[key] = scheduler.get(key, 0.0) + value / (len(parts) if "mean" in key else 1)  # type: ignore[operator]
    drafts = scheduler.get("spec_drafts")
    if isinstance(drafts, (int, float)) and "spec_mean_accepted_length" in scheduler:  # from the totals, not averaged
        accepted = scheduler.get("spec_accepted_tokens", 0.0)
        scheduler["spec_mean_accepted_length"] = 1.0 + accepted / drafts if drafts else 0.0  # type: ignore[operator]
    return EngineStats(
        threads=threads,
        steps=steps,
        step_time_mean_ms=sum(p.step_time_mean_ms * p.steps for p in parts) / steps if steps else 0.0,
        step_time_p99_ms=max(p.step_time_p99_ms for p in parts),
        num_running=sum(p.num_running for p in parts),
        num_waiting=sum(p.num_waiting for p in parts),
        num_preempted_waiting=sum(p.num_preempted_waiting for p in parts),
        preemptions=sum(p.preemptions for p in parts),
        kv_usage=sum(p.kv_usage * p.kv_blocks_total for p in parts) / blocks if blocks else 0.0,
        kv_blocks_total=blocks,
        prefix_cache_hit_rate=(sum(p.prefix_cache_hit_rate * p.prompt_tokens for p in parts) / prompts
                               if prompts else 0.0),
        prompt_tokens=prompts,
        generated_tokens=sum(p.generated_tokens for p in parts),
        queue_depths=queues,
        scheduler=scheduler,
        pipeline_bubble_s=sum(p.pipeline_bubble_s for p in parts),
        pipeline_bubbles=sum(p.pipeline_bubbles for p in parts),
    )
