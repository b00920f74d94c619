"""/metrics exposes the scheduler's speculative decoding counters under vLLM's names."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from pyengine.outputs import EngineHealth, EngineStats
from pyengine.server.metrics import EngineCollector


class _OneCore:
    """An engine client with one core whose scheduler snapshot holds spec counters."""

    def __init__(self, scheduler: dict) -> None:
        self.stats = EngineStats(threads={}, steps=10, step_time_mean_ms=1.0, step_time_p99_ms=2.0, num_running=0,
                                 num_waiting=0, num_preempted_waiting=0, preemptions=0, kv_usage=0.0,
                                 kv_blocks_total=8, prefix_cache_hit_rate=0.0, prompt_tokens=0, generated_tokens=0,
                                 queue_depths={}, scheduler=scheduler)

    def engine_health(self):
        return [EngineHealth(dead_reason=None, steps=10, num_unfinished=0)]

    def engine_stats(self):
        return {0: self.stats}


def render(scheduler: dict) -> str:
    registry = CollectorRegistry()
    registry.register(EngineCollector(_OneCore(scheduler), "m"))
    return generate_latest(registry).decode()


def test_spec_counters_and_mean_accepted_length():
    text = render({"spec_drafts": 4, "spec_draft_tokens": 12, "spec_accepted_tokens": 6,
                   "spec_accepted_per_position": [3, 2, 1], "spec_disabled_sequences": 1,
                   "spec_mean_accepted_length": 2.5, "spec_backoffs": 3, "spec_pauses": 1})
    assert 'pyengine:spec_decode_num_drafts_total{engine="0",model_name="m"} 4.0' in text
    assert 'pyengine:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 12.0' in text
    assert 'pyengine:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 6.0' in text
    assert 'pyengine:spec_decode_mean_accepted_length{engine="0",model_name="m"} 2.5' in text
    assert 'pyengine:spec_decode_disabled_sequences_total{engine="0",model_name="m"} 1.0' in text
    assert 'pyengine:spec_decode_backoffs_total{engine="0",model_name="m"} 3.0' in text
    assert 'pyengine:spec_decode_pauses_total{engine="0",model_name="m"} 1.0' in text
    for position, n in enumerate([3, 2, 1]):
        assert (f'pyengine:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",'
                f'position="{position}"}} {float(n)}') in text


def test_speculation_off_reads_zero():
    text = render({})
    assert 'pyengine:spec_decode_num_drafts_total{engine="0",model_name="m"} 0.0' in text
    assert "pyengine:spec_decode_num_accepted_tokens_per_pos_total{" not in text


def _stats(scheduler: dict) -> EngineStats:
    return _OneCore(scheduler).stats


def test_spec_counters_cross_the_wire_and_add_up_over_cores():
    import msgspec

    from pyengine.multiprocess.stats_merge import merge_stats
    from pyengine.multiprocess.wire import Reply

    one = _stats({"spec_drafts": 4, "spec_accepted_tokens": 6, "spec_accepted_per_position": [3, 2, 1],
                  "spec_mean_accepted_length": 2.5})
    two = _stats({"spec_drafts": 4, "spec_accepted_tokens": 2, "spec_accepted_per_position": [2, 0, 0],
                  "spec_mean_accepted_length": 1.5})
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(Reply(0, 1, one)), type=Reply)
    assert decoded.stats.scheduler["spec_accepted_per_position"] == [3, 2, 1]
    merged = merge_stats([one, two]).scheduler
    assert merged["spec_accepted_per_position"] == [5, 2, 1]
    assert merged["spec_mean_accepted_length"] == 1 + 8 / 8
