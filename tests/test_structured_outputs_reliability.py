"""64 concurrent constrained streams at pipeline depth 2 on a small KV pool (so sequences
are preempted and recomputed), with n > 1 and aborts: every output that finished with
"stop" validates against its schema, every output that finished with "length" is a prefix
its grammar accepts (its tokens replayed through a fresh matcher, mask by mask), nothing
raises, and every KV block comes back."""

from __future__ import annotations

import asyncio
import json
import time

import jsonschema
import numpy as np
import pytest

from pyengine import AsyncEngine, Request, SamplingParams, Scheduler, SchedulerConfig, StructuredOutputsParams
from pyengine.testing.checkpoints import make_tiny_checkpoint

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "maxLength": 12},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string", "maxLength": 4}, "qty": {"type": "integer",
                                                                                     "minimum": 1, "maximum": 9}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
            "urgent": {"type": "boolean"},
        },
        "required": ["items", "urgent"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "score": {"type": "integer", "minimum": -5, "maximum": 5},
            "topics": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
        },
        "required": ["sentiment", "score", "topics"],
        "additionalProperties": False,
    },
]
NUM_STREAMS = 64


def max_tokens_of(i: int) -> int:
    """Room to finish, except every fifth stream: cut short, to end with "length"."""
    return 10 if i % 5 == 1 else 96


def constraint_of(schema: dict) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def refused_at(constraint, tokens: list[int]) -> int:
    """The index of the first of ``tokens`` the constraint's matcher refuses (-1: none):
    the tokens are replayed through a scheduler of their own, each checked against the
    mask of its step before it is applied."""
    s = Scheduler(SchedulerConfig(64, block_size=16, max_model_len=len(tokens) + 16))
    s.add_request(Request("replay", [0], max_tokens=len(tokens) + 8, constraint=constraint))
    for k, token in enumerate(tokens):
        plan = s.schedule()
        bits, _ = plan.grammar_mask.take(5.0)
        if not bits[0, token // 32] >> np.uint32(token % 32) & 1:
            return k
        s.apply_result(plan.step_id, np.array([token], dtype=np.int64))
        s.take_output(plan.step_id)
    return -1


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("reliability") / "qwen3", "qwen3", seed=11)


def test_concurrent_constrained_streams_with_preemption_aborts_and_n(checkpoint):
    engine = AsyncEngine(str(checkpoint), pipeline_depth=2, max_num_seqs=64, num_kv_blocks=40, block_size=16)

    async def stream(i: int):
        schema = SCHEMAS[i % len(SCHEMAS)]
        params = SamplingParams(
            n=2 if i % 4 == 0 else 1, temperature=1.0, seed=i, max_tokens=max_tokens_of(i),
            structured_outputs=constraint_of(schema),
        )
        prompt = f"request {i}: " + "tell me something " * (i % 7)
        last = None
        async for out in engine.generate(prompt, params, request_id=f"s{i}"):
            last = out
            if i % 9 == 0:
                break  # leaving early aborts the request
        return i, schema, last

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(stream(i) for i in range(NUM_STREAMS))), timeout=300)

    try:
        results = asyncio.run(main())
        deadline = time.monotonic() + 10
        # Blocks return once no in-flight step references them: just after the last finish.
        while (engine.engine_core.num_unfinished() or engine.engine_core.stats().kv_usage > 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = engine.engine_core.stats()
        compiled = [engine.engine_core.constraints.compile(constraint_of(schema)) for schema in SCHEMAS]
    finally:
        engine.shutdown()

    assert len(results) == NUM_STREAMS
    reasons: dict[str, int] = {}
    for i, schema, last in results:
        assert last is not None
        if i % 9 == 0:
            continue  # it left after its first output: aborted
        assert last.finished
        assert len(last.outputs) == (2 if i % 4 == 0 else 1)
        for c in last.outputs:
            reasons[c.finish_reason] = reasons.get(c.finish_reason, 0) + 1
            assert c.finish_reason in ("stop", "length"), (i, c.finish_reason, c.text)
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.text), schema)
                assert refused_at(compiled[i % len(SCHEMAS)], list(reversed(c.token_ids))) >= 0  # the replay refuses
            else:  # "length": every token was allowed, in order, by a fresh matcher
                assert len(c.token_ids) == max_tokens_of(i), (i, len(c.token_ids))
                assert refused_at(compiled[i % len(SCHEMAS)], list(c.token_ids)) == -1, (i, c.text)
    assert reasons.get("stop", 0) >= 40, reasons
    assert reasons.get("length", 0) >= 5, reasons
    assert stats.preemptions > 0, "the small pool was meant to force preemption"
    assert stats.kv_usage == 0.0 and stats.num_running == 0 and stats.num_waiting == 0
    assert stats.scheduler["masks_computed"] > 0
