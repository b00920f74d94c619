"""64 concurrent constrained streams through the server (issue 14's reliability bar, seen
from a client): JSON schemas, regexes and forced tool calls, n > 1, clients that hang up
mid-stream, on a KV pool small enough that sequences are preempted, at pipeline depth 2.
Every choice that finished on its own validates (``jsonschema``, ``re``), no stream
carries an error, and the engine ends idle with every KV block back. The official openai
client (async) speaks to a live server on loopback."""

from __future__ import annotations

import asyncio
import json
import re
import time

import jsonschema
import openai
import pytest

from pyengine import AsyncEngine
from pyengine.server import ServerArgs
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.live_server import LiveServer

COMPACT = {"whitespace_flexible": False}
ORDER = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "maxLength": 4},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "urgent": {"type": "boolean"},
    },
    "required": ["items", "urgent"],
    "additionalProperties": False,
    "x-guidance": COMPACT,
}
REGEX = r"[A-Z]{2}-[0-9]{2,4}"
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"key": {"type": "string", "maxLength": 6}}, "required": ["key"],
    "additionalProperties": False}}}
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NUM_STREAMS = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    # 24 blocks of 16 tokens for up to 32 running sequences: preemption is certain.
    engine = AsyncEngine(path, max_num_seqs=32, max_model_len=256, num_kv_blocks=24, block_size=16,
                         pipeline_depth=2)
    args = ServerArgs(model_name="m", chat_template=TEMPLATE, stats_interval=0, log_requests=False,
                      tool_call_parser="hermes", max_concurrent_requests=256)
    with LiveServer(engine, args) as live:
        yield live, engine
    engine.shutdown()


def request_kind(i: int) -> dict:
    kind = i % 3
    if kind == 0:
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}}}
    if kind == 1:
        return {"extra_body": {"guided_regex": REGEX}}
    return {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "lookup"}}}


def check_choice(i: int, text: str, calls: dict[int, list[str]], reason: str) -> bool:
    """Validates a finished choice; False for one cut by max_tokens (a prefix)."""
    kind = i % 3
    if reason == "length":
        return False
    if kind == 0:
        assert reason == "stop"
        jsonschema.validate(json.loads(text), ORDER)
    elif kind == 1:
        assert reason == "stop" and re.fullmatch(REGEX, text), text
    else:
        assert reason == "stop" and len(calls) == 1, (text, calls)  # a named function: "stop", as OpenAI
        name, arguments = calls[0][0], "".join(calls[0][1:])
        assert name == "lookup"
        jsonschema.validate(json.loads(arguments), TOOL["function"]["parameters"])
    return True


async def one_stream(client: openai.AsyncOpenAI, i: int) -> tuple[str, int, int]:
    """Runs request ``i``; returns how it ended ("done" or "hung up"), its choices and
    how many of them finished on their own (and validated)."""
    n = 2 if i % 4 == 0 else 1
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": f"request {i}"}], max_tokens=80, n=n, temperature=1.0,
        seed=i, stream=True, **request_kind(i))
    texts: dict[int, str] = {}
    calls: dict[int, dict[int, list[str]]] = {}
    reasons: dict[int, str] = {}
    chunks = 0
    async for chunk in stream:
        chunks += 1
        if i % 8 == 7 and chunks == 3:  # this client hangs up mid-stream: the server aborts it
            await stream.close()
            return "hung up", n, 0
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            for delta in choice.delta.tool_calls or []:
                parts = calls.setdefault(choice.index, {}).setdefault(delta.index, [])
                if delta.function and delta.function.name:
                    parts.append(delta.function.name)
                if delta.function and delta.function.arguments:
                    parts.append(delta.function.arguments)
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert sorted(reasons) == list(range(n)), reasons
    finished = sum(check_choice(i, texts.get(index, ""), calls.get(index, {}), reason)
                   for index, reason in reasons.items())
    return "done", n, finished


def test_64_concurrent_constrained_streams(server):
    live, engine = server
    preempted_before = engine.stats().preemptions

    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="x", timeout=120, max_retries=0) as client:
            return await asyncio.gather(*(one_stream(client, i) for i in range(NUM_STREAMS)))

    results = asyncio.run(run_all())
    endings = [ending for ending, _, _ in results]
    assert endings.count("hung up") == NUM_STREAMS // 8 and endings.count("done") == NUM_STREAMS - NUM_STREAMS // 8
    choices = sum(n for ending, n, _ in results if ending == "done")
    validated = sum(finished for _, _, finished in results)
    assert validated >= 0.9 * choices, f"only {validated} of {choices} choices finished on their own"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_usage == 0:
            break
        time.sleep(0.05)
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0), stats
    assert stats.preemptions > preempted_before, "the pool was meant to force preemption"
    assert engine.is_alive
