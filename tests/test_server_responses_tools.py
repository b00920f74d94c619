"""Function tools on the Responses API, through the official openai client: ``auto`` parses
the model's calls with the server's ``--tool-call-parser`` into ``function_call`` items,
streamed as ``response.function_call_arguments.delta`` events; an agent loop sends the
results back as ``function_call_output`` items, after ``previous_response_id`` or with the
calls spelled out, and the model sees them as chat's tool turns.

As in ``test_server_tool_calls.py`` the executor is scripted (a random-weight model writes
no tool calls): every sequence answers ``HERMES_ANSWER`` then EOS."""

from __future__ import annotations

import contextlib
import json

import httpx
import openai
import pytest
from test_server_tool_calls import HERMES_ANSWER, TEMPLATE, WEATHER_ARGS, tokenizer

from pyengine import AsyncEngine
from pyengine.config import EngineConfig
from pyengine.engine.core import EngineCore
from pyengine.models.default_tokenizer import EOS_TOKEN
from pyengine.server import ServerArgs
from pyengine.testing.live_server import LiveServer
from pyengine.testing.synthetic_runner import ScriptedRunner

TOOLS = [
    {"type": "function", "name": "get_weather", "description": "The weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}},
]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
QUESTION = "Weather in Paris, and the time?"


@contextlib.contextmanager
def serving(answer: str):
    tok = tokenizer()
    eos = tok.convert_tokens_to_ids(EOS_TOKEN)
    runner = ScriptedRunner(tok.encode(answer, add_special_tokens=False) + [eos], eos_token_ids=(eos,))
    engine = AsyncEngine.from_engine_core(EngineCore(EngineConfig(max_num_seqs=8), runner=runner))
    args = ServerArgs(model_name="m", chat_template=TEMPLATE, stats_interval=0, log_requests=False,
                      tool_call_parser="hermes", enable_auto_tool_choice=True)
    try:
        with LiveServer(engine, args) as server:
            with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=30, max_retries=0) as client:
                yield server, client
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def served():
    with serving(HERMES_ANSWER) as pair:
        yield pair


def shape(output):
    """What an output says, without its fresh ids."""
    return [(item.type, getattr(item, "name", None), getattr(item, "arguments", None),
             "".join(c.text for c in item.content) if item.type == "message" else None) for item in output]


def assert_calls(output):
    message, weather, time_ = output
    assert message.type == "message" and message.content[0].text == "Checking both.\n"
    assert [weather.type, time_.type] == ["function_call", "function_call"]
    assert (weather.name, json.loads(weather.arguments)) == ("get_weather", WEATHER_ARGS)
    assert (time_.name, json.loads(time_.arguments)) == ("get_time", {})
    assert all(c.call_id.startswith("call_") and c.id.startswith("fc_") for c in (weather, time_))
    assert weather.call_id != time_.call_id


def test_auto_returns_function_call_items(served):
    _, client = served
    out = client.responses.create(model="m", input=QUESTION, tools=TOOLS)
    assert out.status == "completed"
    assert_calls(out.output)
    assert [t.name for t in out.tools] == ["get_weather", "get_time"]


def test_stream_events_for_text_then_calls_equal_the_whole_response(served):
    _, client = served
    whole = client.responses.create(model="m", input=QUESTION, tools=TOOLS)
    with client.responses.stream(model="m", input=QUESTION, tools=TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert shape(final.output) == shape(whole.output)
    assert_calls(final.output)
    assert final.usage.output_tokens == whole.usage.output_tokens
    # Collapse each run of deltas to one entry: the order of the events that frame them.
    kinds = [e.type for e in events]
    framed = [k for i, k in enumerate(kinds) if not (k.endswith(".delta") and i and kinds[i - 1] == k)]
    item_events = ["response.output_item.added", "response.function_call_arguments.delta",
                   "response.function_call_arguments.done", "response.output_item.done"]
    assert framed == ["response.created", "response.in_progress",
                      "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                      "response.output_text.done", "response.content_part.done", "response.output_item.done",
                      *item_events, *item_events, "response.completed"]
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1, 2]
    argument_deltas = [e for e in events if e.type == "response.function_call_arguments.delta"
                       and e.output_index == 1]
    assert len(argument_deltas) > 3, "arguments stream in pieces as they are generated"
    assert json.loads("".join(e.delta for e in argument_deltas)) == WEATHER_ARGS
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, json.loads(e.arguments)) for e in done] == [("get_weather", WEATHER_ARGS), ("get_time", {})]


def tokens(server, messages) -> int:
    out = httpx.post(f"{server.url}/tokenize", json={"messages": messages, "tools": CHAT_TOOLS}, timeout=30)
    out.raise_for_status()
    return out.json()["count"]


def test_agent_loop_sends_function_call_outputs_back(served):
    server, client = served
    first = client.responses.create(model="m", input=QUESTION, tools=TOOLS)
    _, weather, time_ = first.output
    results = [{"type": "function_call_output", "call_id": weather.call_id, "output": "sunny, 21C"},
               {"type": "function_call_output", "call_id": time_.call_id, "output": "10:00"}]
    chained = client.responses.create(model="m", previous_response_id=first.id, input=results, tools=TOOLS)
    # The same turns spelled as chat messages: the assistant's text and both calls are one turn.
    calls = [{"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in (weather, time_)]
    messages = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": "Checking both.\n", "tool_calls": calls},
                {"role": "tool", "tool_call_id": weather.call_id, "content": "sunny, 21C"},
                {"role": "tool", "tool_call_id": time_.call_id, "content": "10:00"}]
    assert chained.usage.input_tokens == tokens(server, messages)
    # Without the store: the earlier turn sent back as items gives the same prompt.
    items = [{"role": "user", "content": QUESTION},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Checking both.\n"}]},
             *[{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
               for c in (weather, time_)], *results]
    spelled = client.responses.create(model="m", input=items, tools=TOOLS, store=False)
    assert spelled.usage.input_tokens == chained.usage.input_tokens


def test_tool_choice_none_and_parallel_calls_off(served):
    _, client = served
    plain = client.responses.create(model="m", input=QUESTION, tools=TOOLS, tool_choice="none")
    assert shape(plain.output) == [("message", None, None, HERMES_ANSWER)]
    one = client.responses.create(model="m", input=QUESTION, tools=TOOLS, parallel_tool_calls=False)
    assert [item.type for item in one.output] == ["message", "function_call"]
    assert one.output[1].name == "get_weather" and one.parallel_tool_calls is False


def test_malformed_function_call_items_are_400s(served):
    _, client = served
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", tools=TOOLS, input=[
            {"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c1", "name": "get_time"}])
    assert info.value.body["param"] == "input[1].arguments"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", tools=TOOLS, input=[
            {"role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{not json"}])
    assert info.value.body["param"] == "input[1].arguments"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="m", input="hi", tools=TOOLS, tool_choice={"type": "function", "name": "nope"})
    assert info.value.body["param"] == "tool_choice.name"


class FailingRunner(ScriptedRunner):
    """The scripted answer for a few steps, then the executor fails (a device lost, say)."""

    def __init__(self, script: list[int], steps: int, **kwargs) -> None:
        super().__init__(script, **kwargs)
        self.steps_left = steps

    def execute(self, plan):
        self.steps_left -= 1
        if self.steps_left < 0:
            raise RuntimeError("the device is gone")
        return super().execute(plan)


def test_an_engine_failure_mid_stream_is_a_response_failed_event():
    tok = tokenizer()
    eos = tok.convert_tokens_to_ids(EOS_TOKEN)
    runner = FailingRunner(tok.encode(HERMES_ANSWER, add_special_tokens=False) + [eos], steps=4,
                           eos_token_ids=(eos,))
    engine = AsyncEngine.from_engine_core(EngineCore(EngineConfig(max_num_seqs=8), runner=runner))
    try:
        with LiveServer(engine, ServerArgs(model_name="m", chat_template=TEMPLATE, stats_interval=0,
                                           log_requests=False)) as server:
            with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=30, max_retries=0) as client:
                events = list(client.responses.create(model="m", input=QUESTION, stream=True))
    finally:
        engine.shutdown()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.failed"
    assert "response.output_text.delta" in kinds, "the text before the failure was streamed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code and failed.error.message
    assert "the device is gone" not in failed.error.message, "internals stay in the server's log"
