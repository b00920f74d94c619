"""The Responses API (``POST /v1/responses``) through the official openai client against a
real ``pyengine serve`` (the built-in tiny model, its engine core in its own process) on
loopback: string and item input, instructions, text.format json_schema, previous_response_id
chains on a store bounded to 2 responses, the stream's typed events, and the refusals.

What a response renders is checked against the chat endpoint: the same conversation sent
as chat messages to ``/tokenize`` gives ``usage.input_tokens``, and under greedy decoding
the response's text is the chat completion's."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server_tool_calls import FORCED_TOOLS, SCHEMAS

from pyengine.testing.serve_process import ServeProcess
from pyengine.testing.waits import wait_until

MODEL = "tiny"
STORE_SIZE = 2
# llguidance's option: no free whitespace, so that a random-weight model's JSON ends.
COMPACT = {"whitespace_flexible": False}


@pytest.fixture(scope="module")
def server():
    with ServeProcess(["--served-model-name", MODEL, "--stats-interval", "0", "--log-level", "warning",
                       "--max-model-len", "512", "--responses-store-size", str(STORE_SIZE)]) as proc:
        yield proc.wait_up()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=60, max_retries=0) as c:
        yield c


def prompt_tokens(server, messages) -> int:
    out = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": messages}, timeout=30)
    out.raise_for_status()
    return out.json()["count"]


def chat_text(client, messages, max_tokens) -> str:
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens)
    return out.choices[0].message.content


def test_string_input_with_instructions_is_the_chat_answer(server, client):
    out = client.responses.create(model=MODEL, input="Tell me about foxes.", instructions="Be brief.",
                                  temperature=0, max_output_tokens=8)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about foxes."}]
    assert out.object == "response" and out.id.startswith("resp_")
    assert out.model == MODEL and out.instructions == "Be brief."
    assert out.usage.input_tokens == prompt_tokens(server, messages)
    assert out.usage.output_tokens == 8
    assert out.usage.total_tokens == out.usage.input_tokens + 8
    # Random weights rarely stop on their own: cut by max_output_tokens, as OpenAI says it.
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    [message] = out.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text"
    assert out.output_text == message.content[0].text == chat_text(client, messages, 8)


def test_item_input_roles_and_parts(server, client):
    items = [
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"},
                                                        {"type": "input_text", "text": " there"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Bonjour"}]},
        {"role": "user", "content": "Again?"},
    ]
    out = client.responses.create(model=MODEL, input=items, temperature=0, max_output_tokens=6)
    messages = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hello there"},
                {"role": "assistant", "content": "Bonjour"}, {"role": "user", "content": "Again?"}]
    assert out.usage.input_tokens == prompt_tokens(server, messages)
    assert out.output_text == chat_text(client, messages, 6)


def test_json_schema_format_is_enforced(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "x-guidance": COMPACT}
    out = client.responses.create(model=MODEL, input="A person as JSON", max_output_tokens=120, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                   "strict": True}})
    assert out.status == "completed", "the grammar ends the answer once the object closes"
    # strict closes the object (additionalProperties false), as OpenAI's strict mode reads a schema.
    jsonschema.validate(json.loads(out.output_text), {**schema, "additionalProperties": False})
    assert out.text.format.type == "json_schema"


# What may follow a cut JSON text before its brackets close: a partial literal, number,
# escape or key ending, an element after a trailing comma.
_FILLERS = ["", "0", "null", ":null", '":null', '"k":null', "ue", "rue", "e", "alse", "lse", "se", "ull",
            "ll", "l", "n", "0", "00", "000", "0000", "e0", "0e0"]


def completes_to_json(text: str) -> bool:
    """Whether ``text`` is the start of some JSON value: a filler and the closing quote
    and brackets it lacks make it parse."""
    for filler in _FILLERS:
        candidate = text + filler
        stack, in_string, escaped = [], False, False
        for ch in candidate:
            if in_string:
                escaped, in_string = (not escaped and ch == "\\"), in_string and (escaped or ch != '"')
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                stack.append("}" if ch == "{" else "]")
            elif ch in "}]" and stack:
                stack.pop()
        closed = candidate + ('"' if in_string else "") + "".join(reversed(stack))
        for tail in ("", ":null"):  # a key cut right after its closing quote
            try:
                json.loads(closed[:len(closed) - len(stack)] + tail + "".join(reversed(stack)) if tail else closed)
                return True
            except ValueError:
                continue
    return False


def test_completes_to_json_tells_cut_objects_from_other_text():
    for cut in ['{', '{"a', '{"a"', '{"a": ', '{"a": 1', '{"a": 1.', '{"a": tr', '{"a": "x\\', '{"a": [1,',
                '{"a": {"b": nul']:
        assert completes_to_json(cut), cut
    for bad in ['{"a": 1}}', '{]', '{"a" 1', 'hello']:
        assert not completes_to_json(bad), bad


def test_json_object_format(client):
    out = client.responses.create(model=MODEL, input="JSON please", max_output_tokens=120, temperature=0,
                                  text={"format": {"type": "json_object"}})
    text = out.output_text
    assert text.lstrip().startswith("{")
    if out.status == "completed":  # the grammar ended the answer: one whole object
        assert out.incomplete_details is None and out.usage.output_tokens <= 120
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_output_tokens while the object was still open: a prefix of one, not a whole one
        assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
        assert out.usage.output_tokens == 120
        with pytest.raises(ValueError):
            json.loads(text)
        assert completes_to_json(text), text


def test_previous_response_id_chains_the_conversation(server, client):
    first = client.responses.create(model=MODEL, input="First question", instructions="Old rules.",
                                    temperature=0, max_output_tokens=5)
    second = client.responses.create(model=MODEL, input="Second question", previous_response_id=first.id,
                                     instructions="New rules.", temperature=0, max_output_tokens=5)
    # Earlier instructions are not carried along (OpenAI's rule); the earlier turns are.
    messages = [{"role": "system", "content": "New rules."}, {"role": "user", "content": "First question"},
                {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "Second question"}]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == prompt_tokens(server, messages)
    assert second.output_text == chat_text(client, messages, 5)
    third = client.responses.create(model=MODEL, input="Third", previous_response_id=second.id, temperature=0,
                                    max_output_tokens=3)
    messages = messages[1:] + [{"role": "assistant", "content": second.output_text},
                               {"role": "user", "content": "Third"}]
    assert third.usage.input_tokens == prompt_tokens(server, messages)
    # The store keeps STORE_SIZE (2) responses: the first is evicted, the last two are there.
    fetched = client.responses.retrieve(third.id)
    assert fetched.id == third.id and fetched.output_text == third.output_text
    assert client.responses.retrieve(second.id).usage.input_tokens == second.usage.input_tokens
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(first.id)
    assert info.value.body["message"] == f"Response with id '{first.id}' not found."


def test_unknown_previous_response_id_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_nope", max_output_tokens=2)
    body = info.value.body
    assert body["type"] == "invalid_request_error" and body["param"] == "previous_response_id"
    assert body["message"] == "Response with id 'resp_nope' not found."


def test_store_false_is_not_kept(client):
    out = client.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=2)
    assert out.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(out.id)


def test_stream_events_typed_in_order_and_equal_to_the_whole_response(client):
    kwargs = {"model": MODEL, "input": "Stream this", "instructions": "Be brief.", "temperature": 0,
              "max_output_tokens": 10}
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert deltas > 1, "the text streams in pieces"
    assert events[0].response.status == "in_progress"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    final = events[-1].response
    for name in ("input_tokens", "output_tokens", "total_tokens"):
        assert getattr(final.usage, name) == getattr(whole.usage, name)
    # The same prompt again: its full blocks come from the prefix cache, and usage says so.
    assert 0 < final.usage.input_tokens_details.cached_tokens < final.usage.input_tokens
    assert final.status == whole.status == "incomplete"
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}


def test_stream_helper_assembles_the_final_response(client):
    # With a json_schema format the answer ends on its own, so the stream ends with response.completed,
    # which the client's helper needs for get_final_response.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False, "x-guidance": COMPACT}
    kwargs = {"model": MODEL, "input": "ok?", "temperature": 0, "max_output_tokens": 60,
              "text": {"format": {"type": "json_schema", "name": "ok", "schema": schema}}}
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert events[-1].type == "response.completed"
    assert final.output_text == whole.output_text
    assert json.loads(final.output_text) == json.loads(whole.output_text)
    assert final.usage.output_tokens == whole.usage.output_tokens


FLAT_TOOLS = [{"type": "function", **tool["function"]} for tool in FORCED_TOOLS]


def assert_valid_calls(output, names):
    assert [item.type for item in output] == ["function_call"] * len(names)
    assert [item.name for item in output] == names
    for item in output:
        assert item.call_id.startswith("call_") and item.id.startswith("fc_")
        jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])


def test_required_without_a_parser_is_constrained_to_calls(client):
    # No --tool-call-parser: vLLM's JSON array of calls, through chat's forced path (forced_tools.py).
    kwargs = {"model": MODEL, "input": "Weather?", "tools": FLAT_TOOLS, "tool_choice": "required",
              "parallel_tool_calls": False, "temperature": 0, "max_output_tokens": 200}
    whole = client.responses.create(**kwargs)
    assert whole.status == "completed"
    assert_valid_calls(whole.output, [whole.output[0].name])
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [(i.name, i.arguments) for i in final.output] == [(i.name, i.arguments) for i in whole.output]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == whole.output[0].arguments


def test_named_function_without_a_parser(client):
    out = client.responses.create(model=MODEL, input="Time?", tools=FLAT_TOOLS, temperature=0, max_output_tokens=100,
                                  tool_choice={"type": "function", "name": "get_time"})
    assert out.status == "completed"
    assert_valid_calls(out.output, ["get_time"])


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "built-in"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type", "file search"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0].type", "reasoning"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning parser"),
    ({"background": True}, "background", "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type", "text only"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "one of"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type", "json_schema"),
    ({"max_output_tokens": 100000}, "max_output_tokens", "maximum context length"),
    ({"tools": [{"type": "function", "name": "f"}]}, "tool_choice", "--enable-auto-tool-choice"),
])
def test_refusals_name_the_field(client, fields, param, words):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**body)
    error = info.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert words in error["message"]


def test_unknown_response_id_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve("resp_unknown")
    assert info.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")


def test_a_streamed_response_is_stored_and_cannot_be_cancelled_or_replayed(server, client):
    events = list(client.responses.create(model=MODEL, input="keep me", max_output_tokens=4, stream=True,
                                          metadata={"run": "7"}))
    final = events[-1].response
    fetched = client.responses.retrieve(final.id)
    assert fetched.model_dump() == final.model_dump()
    assert fetched.metadata == {"run": "7"}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.cancel(final.id)
    assert info.value.body["message"] == "Cannot cancel a synchronous response."
    replay = httpx.get(f"{server.url}/v1/responses/{final.id}", params={"stream": "true"}, timeout=10)
    assert replay.status_code == 400 and replay.json()["error"]["param"] == "stream"


def metric(server, name: str) -> float:
    """The sum of ``name``'s samples on ``/metrics``."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name)


def test_a_client_leaving_mid_stream_aborts_the_request(server):
    generated = metric(server, "pyengine:generation_tokens_total")
    left = metric(server, "pyengine:request_client_disconnects_total")
    body = {"model": MODEL, "input": "Go on", "max_output_tokens": 400, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.url}/v1/responses", json=body) as resp:
            assert resp.status_code == 200
            events = [line for line, _ in zip(resp.iter_lines(), range(40)) if line.startswith("event: ")]
            assert "event: response.output_text.delta" in events
    assert wait_until(lambda: metric(server, "pyengine:request_client_disconnects_total") > left, 10.0)
    assert wait_until(lambda: metric(server, "pyengine:num_requests_running") == 0, 10.0)
    assert metric(server, "pyengine:generation_tokens_total") - generated < 400, "aborted before the end"
