"""Prometheus metrics (``GET /metrics``), named like vLLM's with a ``pyengine:`` prefix.

Two sources, both in one per-app ``CollectorRegistry`` (no global registry):

- ``EngineCollector`` reads each engine core's ``EngineStats`` at scrape time (an
  ``engine`` label tells the cores apart): running / waiting requests,
  KV usage, token and preemption counters, prefix-cache queries and hits, per-thread
  busy / idle seconds, step time, queue depths and pipeline bubbles, speculative
  decoding's drafts and accepted tokens (docs/speculative_decoding.md).
- ``ServerMetrics`` observes each finished request on the asyncio side: TTFT,
  inter-token latency, end-to-end, queue, prefill and decode time, finish reasons.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pyengine.entrypoints.engine_client import EngineClient
from pyengine.errors import EngineError
from pyengine.outputs import EngineStats, RequestMetrics, RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineCollector(Collector):
    """Engine figures, read from ``EngineClient.engine_stats()`` when scraped: one series
    per engine core, labelled ``engine`` with its index ("0", "1", ... with data
    parallelism). A dead core's series are left out, the live ones' stay;
    ``pyengine:engine_alive`` says which cores serve."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.engine_client = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        m = self.model_name
        alive = GaugeMetricFamily("pyengine:engine_alive", "1 while the engine core serves, 0 once it is dead.",
                                  labels=["model_name", "engine"])
        for index, health in enumerate(self.engine_client.engine_health()):
            alive.add_metric([m, str(index)], 1.0 if health.alive else 0.0)
        yield alive
        try:
            parts = sorted(self.engine_client.engine_stats().items())
        except EngineError:
            parts = []  # no engine can answer: /health says why
        for kind, name, doc, value in _SERIES:
            family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = family_type(f"pyengine:{name}", doc, labels=["model_name", "engine"])
            for index, s in parts:
                family.add_metric([m, str(index)], value(s))
            yield family
        busy = CounterMetricFamily("pyengine:thread_busy_seconds", "Busy seconds of each engine thread.",
                                   labels=["model_name", "engine", "thread"])
        idle = CounterMetricFamily("pyengine:thread_idle_seconds", "Seconds each engine thread waited for work.",
                                   labels=["model_name", "engine", "thread"])
        depth = GaugeMetricFamily("pyengine:queue_depth", "Items queued between the engine threads.",
                                  labels=["model_name", "engine", "queue"])
        for index, s in parts:
            for thread, t in s.threads.items():
                busy.add_metric([m, str(index), thread], t["busy_s"])
                idle.add_metric([m, str(index), thread], t["idle_s"])
            for queue, n in s.queue_depths.items():
                depth.add_metric([m, str(index), queue], n)
        yield busy
        yield idle
        yield depth
        per_position = CounterMetricFamily(
            "pyengine:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position in the draft.",
            labels=["model_name", "engine", "position"])
        for index, s in parts:
            for position, n in enumerate(s.scheduler.get("spec_accepted_per_position", ()) or ()):
                per_position.add_metric([m, str(index), str(position)], n)
        yield per_position


# (kind, name, help, value) of each per-engine series.
_SERIES: tuple[tuple[str, str, str, Callable[[EngineStats], float]], ...] = (
    ("gauge", "num_requests_running", "Requests in the running batch.", lambda s: s.num_running),
    ("gauge", "num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.num_waiting),
    ("gauge", "num_requests_preempted_waiting", "Preempted requests waiting to resume.",
     lambda s: s.num_preempted_waiting),
    ("gauge", "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", lambda s: s.kv_usage),
    ("gauge", "kv_cache_blocks_total", "KV-cache blocks in the pool.", lambda s: s.kv_blocks_total),
    ("counter", "prompt_tokens", "Prompt tokens of finished requests.", lambda s: s.prompt_tokens),
    ("counter", "generation_tokens", "Generated tokens.", lambda s: s.generated_tokens),
    ("counter", "num_preemptions", "Preemptions (by recompute).", lambda s: s.preemptions),
    ("counter", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     lambda s: s.scheduler.get("prefix_cache_queried_tokens", 0)),
    ("counter", "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
     lambda s: s.scheduler.get("prefix_cache_hit_tokens", 0)),
    ("counter", "engine_steps", "Steps the executor ran.", lambda s: s.steps),
    ("gauge", "step_time_mean_seconds", "Mean executor step time over the last 2048 steps.",
     lambda s: s.step_time_mean_ms / 1e3),
    ("gauge", "step_time_p99_seconds", "p99 executor step time over the last 2048 steps.",
     lambda s: s.step_time_p99_ms / 1e3),
    ("gauge", "plan_time_mean_seconds", "Mean scheduler planning time per step.",
     lambda s: s.scheduler.get("plan_us_mean", 0.0) / 1e6),
    ("counter", "pipeline_bubble_seconds", "Executor time waiting for a plan while requests were live.",
     lambda s: s.pipeline_bubble_s),
    ("counter", "pipeline_bubbles", "Executor waits for a plan while requests were live.",
     lambda s: s.pipeline_bubbles),
    ("counter", "spec_decode_num_drafts", "Sequence-steps that carried drafts (speculative decoding).",
     lambda s: s.scheduler.get("spec_drafts", 0)),
    ("counter", "spec_decode_num_draft_tokens", "Draft tokens proposed.",
     lambda s: s.scheduler.get("spec_draft_tokens", 0)),
    ("counter", "spec_decode_num_accepted_tokens", "Draft tokens kept by verification.",
     lambda s: s.scheduler.get("spec_accepted_tokens", 0)),
    ("gauge", "spec_decode_mean_accepted_length",
     "1 + kept drafts per sequence-step that carried drafts (0 before any).",
     lambda s: s.scheduler.get("spec_mean_accepted_length", 0.0)),
    ("counter", "spec_decode_disabled_sequences",
     "Times the adaptive rule stopped proposing drafts for a sequence (n-gram and suffix: a pause).",
     lambda s: s.scheduler.get("spec_disabled_sequences", 0)),
    ("counter", "spec_decode_pauses",
     "n-gram and suffix turn-offs that pause the sequence and probe again later.",
     lambda s: s.scheduler.get("spec_pauses", 0)),
    ("counter", "spec_decode_backoffs",
     "Drafted steps that kept no draft, after which the sequence decoded plainly for a while.",
     lambda s: s.scheduler.get("spec_backoffs", 0)),
)


class InterTokenTimer:
    """Observes the gap between successive token-bearing outputs of one request."""

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram
        self.last: Optional[float] = None

    def tick(self, num_new_tokens: int) -> None:
        if num_new_tokens <= 0:
            return
        now = time.perf_counter()
        if self.last is not None:
            self.histogram.observe(now - self.last)
        self.last = now


class ServerMetrics:
    """The app's registry and the per-request metrics observed by the handlers."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"pyengine:{name}", doc, labels, buckets=buckets, registry=self.registry)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between successive outputs of a request.",
                        _ITL_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds", "Mean time per output token of a request.",
                         _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.", _REQUEST_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token.", _REQUEST_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "First token to finish.", _REQUEST_BUCKETS)
        self.success = Counter("pyengine:request_success", "Finished sequences by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.disconnects = Counter("pyengine:request_client_disconnects", "Requests aborted because the "
                                   "client went away.", labels, registry=self.registry)
        self.http_errors = Counter("pyengine:http_request_errors", "Requests answered with an error status.",
                                   ["model_name", "status"], registry=self.registry)
        self.registry.register(EngineCollector(engine, model_name))

    def itl_timer(self) -> InterTokenTimer:
        return InterTokenTimer(self.itl.labels(self.model_name))

    def observe_finished(self, output: RequestOutput, num_output_tokens: int) -> None:
        """Latency breakdown and finish reasons of one finished engine request
        (``num_output_tokens``: the longest of its samples)."""
        m = self.model_name
        for completion in output.outputs:
            self.success.labels(m, completion.finish_reason or "unknown").inc()
        t: RequestMetrics = output.metrics
        if t.first_token_time is not None:
            self.ttft.labels(m).observe(max(0.0, t.first_token_time - t.arrival_time))
        if t.finished_time is not None:
            self.e2e.labels(m).observe(max(0.0, t.finished_time - t.arrival_time))
            if t.first_token_time is not None:
                self.decode.labels(m).observe(max(0.0, t.finished_time - t.first_token_time))
                if num_output_tokens > 1:
                    decode = max(0.0, t.finished_time - t.first_token_time)
                    self.tpot.labels(m).observe(decode / (num_output_tokens - 1))
        if t.first_scheduled_time is not None:
            self.queue.labels(m).observe(max(0.0, t.first_scheduled_time - t.arrival_time))
            if t.first_token_time is not None:
                self.prefill.labels(m).observe(max(0.0, t.first_token_time - t.first_scheduled_time))

    def render(self) -> bytes:
        """The exposition text (call off the event loop: it reads the engine's stats)."""
        return generate_latest(self.registry)
