"""Periodic engine-stats log lines: throughput since the last line, queue lengths, KV
usage, per-thread busy fraction, step time and pipeline bubbles."""

from __future__ import annotations

import asyncio
import time

from pyengine.errors import EngineError
from pyengine.server.context import ServerContext


async def log_stats_forever(ctx: ServerContext, interval: float) -> None:
    """Logs one "engine stats" line every ``interval`` seconds while there is activity."""
    last = None
    while True:
        await asyncio.sleep(interval)
        try:
            stats = await asyncio.to_thread(ctx.engine_client.stats)
        except EngineError:
            continue
        now = time.monotonic()
        busy = {name: t["busy_s"] for name, t in stats.threads.items()}
        if last is not None:
            then, prev, prev_busy = last
            dt = max(1e-9, now - then)
            prompt_rate = (stats.prompt_tokens - prev.prompt_tokens) / dt
            gen_rate = (stats.generated_tokens - prev.generated_tokens) / dt
            idle = (gen_rate == 0 and prompt_rate == 0 and stats.num_running == 0 and stats.num_waiting == 0)
            if not idle:
                ctx.logger.info(
                    "engine stats", prompt_tok_s=round(prompt_rate, 1), gen_tok_s=round(gen_rate, 1),
                    running=stats.num_running, waiting=stats.num_waiting, kv_usage=round(stats.kv_usage, 4),
                    preemptions=stats.preemptions, prefix_hit_rate=round(stats.prefix_cache_hit_rate, 4),
                    step_ms_mean=round(stats.step_time_mean_ms, 3), step_ms_p99=round(stats.step_time_p99_ms, 3),
                    busy_frac={k: round((v - prev_busy.get(k, 0.0)) / dt, 3) for k, v in busy.items()},
                    bubble_s=round(stats.pipeline_bubble_s - prev.pipeline_bubble_s, 4),
                    queues=stats.queue_depths,
                )
        last = (now, stats, busy)
