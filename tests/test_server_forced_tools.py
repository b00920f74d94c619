"""Forced tool calls on a server started without any tool flag (vLLM serves them so): a
real random-weight model behind ``pyengine serve``'s app, the official ``openai`` client
in front. ``tool_choice="required"`` is constrained to a JSON array of calls, a named
function to its arguments; both come back as ``tool_calls``, whole or streamed as
OpenAI's deltas, with arguments that validate against the tool's schema."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from test_server_tool_calls import FORCED_TOOLS, SCHEMAS, TEMPLATE, USER

from pyengine import AsyncEngine
from pyengine.server import ServerArgs
from pyengine.testing.live_server import LiveServer

TREE = {"type": "object", "properties": {
    "value": {"type": "integer", "minimum": 0, "maximum": 9},
    "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#"}}},
    "required": ["value"], "additionalProperties": False}
LINKED = {"type": "object", "properties": {"head": {"$ref": "#/$defs/Node"}}, "required": ["head"],
          "additionalProperties": False,
          "$defs": {"Node": {"type": "object", "properties": {"v": {"enum": ["a", "b"]},
                                                              "next": {"$ref": "#/$defs/Node"}},
                             "required": ["v"], "additionalProperties": False}}}
RECURSIVE_TOOLS = [{"type": "function", "function": {"name": "plant", "parameters": TREE}},
                   {"type": "function", "function": {"name": "chain", "parameters": LINKED}}]
RECURSIVE_SCHEMAS = {"plant": TREE, "chain": LINKED}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from pyengine.testing.checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    engine = AsyncEngine(path, max_num_seqs=16, max_model_len=2048)  # the tools' JSON makes long prompts
    args = ServerArgs(model_name="m", chat_template=TEMPLATE, stats_interval=0, log_requests=False)
    try:
        with LiveServer(engine, args) as live:
            yield live
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=60, max_retries=0) as c:
        yield c


def assert_valid_calls(calls, schemas=SCHEMAS, names=None):
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and len(call.id) == 29 and call.type == "function"
        assert call.function.name in (names or schemas)
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


def test_required_answers_valid_calls_with_finish_tool_calls(client):
    out = client.chat.completions.create(model="m", messages=USER, tools=FORCED_TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=200, n=3, temperature=1.0, seed=1)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        assert_valid_calls(choice.message.tool_calls)


def test_required_may_call_several_times(client):
    out = client.chat.completions.create(model="m", messages=USER, tools=FORCED_TOOLS, tool_choice="required",
                                         max_tokens=300, n=4, temperature=1.0, seed=2)
    assert any(choice.finish_reason == "tool_calls" for choice in out.choices)
    for choice in out.choices:
        if choice.finish_reason == "length":  # a random model may chain calls until max_tokens: text, no calls
            assert choice.message.tool_calls is None and choice.message.content
            continue
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert_valid_calls(choice.message.tool_calls)


def test_a_named_function_answers_one_call_with_finish_stop(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model="m", messages=USER, tools=FORCED_TOOLS, tool_choice=named,
                                         max_tokens=200, n=2, temperature=1.0, seed=3)
    for choice in out.choices:  # "stop" for a named function, as vLLM and OpenAI answer it
        assert choice.finish_reason == "stop" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        assert_valid_calls(choice.message.tool_calls, names=["get_weather"])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_are_openais_deltas_the_client_assembles(client, tool_choice):
    kwargs = dict(model="m", messages=USER, tools=FORCED_TOOLS, tool_choice=tool_choice, max_tokens=200,
                  temperature=1.0, seed=5)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    seen, arguments = {}, {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or ():
            if delta.index not in seen:  # a call's first delta: id, type and name
                assert delta.id.startswith("call_") and delta.type == "function" and delta.function.name
                seen[delta.index] = delta.function.name
            else:  # then arguments only
                assert delta.id is None and delta.function.name is None
            arguments[delta.index] = arguments.get(delta.index, "") + (delta.function.arguments or "")
        assert not chunk.choices[0].delta.content
    expected = whole.choices[0].message.tool_calls
    assert [seen[i] for i in sorted(seen)] == [c.function.name for c in expected]  # seeded: the same answer
    assert [arguments[i] for i in sorted(arguments)] == [c.function.arguments for c in expected]
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    with client.chat.completions.stream(**kwargs) as stream:  # the openai client's own helper assembles them
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == ("stop" if isinstance(tool_choice, dict) else "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in expected]
    assert_valid_calls(final.choices[0].message.tool_calls)


def depth(value) -> int:
    """How deep a tree or a chain nests (1: no child)."""
    if isinstance(value, dict):
        kids = value.get("children", []) + ([value["next"]] if "next" in value else [])
        return 1 + max((depth(k) for k in kids), default=0)
    return 0


def test_recursive_ref_schemas_compile_and_constrain_the_calls(client):
    valid, deepest = 0, 0
    for tool_choice in ("required", {"type": "function", "function": {"name": "plant"}},
                        {"type": "function", "function": {"name": "chain"}}):
        out = client.chat.completions.create(model="m", messages=USER, tools=RECURSIVE_TOOLS,
                                             tool_choice=tool_choice, max_tokens=300, n=3, temperature=1.0, seed=7)
        for choice in out.choices:
            if choice.finish_reason == "length":  # a random model may recurse until max_tokens
                assert choice.message.tool_calls is None
                continue
            assert_valid_calls(choice.message.tool_calls, RECURSIVE_SCHEMAS)
            valid += 1
            for call in choice.message.tool_calls:
                arguments = json.loads(call.function.arguments)
                deepest = max(deepest, depth(arguments.get("head", arguments)))
    assert valid >= 3 and deepest >= 3  # the $ref was followed below the root, more than once


def test_an_unknown_function_is_a_400_in_the_error_shape(server):
    body = {"model": "m", "messages": USER, "tools": FORCED_TOOLS, "max_tokens": 4,
            "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tool_choice.function.name" and error["type"] == "invalid_request_error"
    assert "'nope'" in error["message"] and "get_weather" in error["message"]


def test_none_renders_the_tools_and_auto_needs_the_flags(client):
    plain = client.chat.completions.create(model="m", messages=USER, max_tokens=8, temperature=0)
    out = client.chat.completions.create(model="m", messages=USER, tools=FORCED_TOOLS, tool_choice="none",
                                         max_tokens=8, temperature=0)
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content is not None
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens  # the template got the tools
    for kwargs in ({"tool_choice": "auto"}, {}):  # absent with tools means "auto", as in vLLM
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="m", messages=USER, tools=FORCED_TOOLS, max_tokens=8, **kwargs)
        assert info.value.param == "tool_choice" and "--tool-call-parser" in info.value.message


def test_a_forced_choice_still_conflicts_with_another_constraint_and_beam_search(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=USER, tools=FORCED_TOOLS, tool_choice="required",
                                       max_tokens=8, response_format={"type": "json_object"})
    assert info.value.param == "response_format" and info.value.code == "conflicting_constraints"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=USER, tools=FORCED_TOOLS, tool_choice="required",
                                       max_tokens=8, extra_body={"use_beam_search": True, "n": 2})
    assert info.value.param == "tool_choice"
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nothing"}}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=USER, tools=bad, tool_choice="required", max_tokens=8)
    assert info.value.param == "tools"
