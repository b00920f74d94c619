"""Constraint and tool fields the server cannot honour are 400s naming the field, never a
200 with free text (issue 14: "any constraint field the server does not honour must be
rejected with 400, never ignored"). Spoken through the official openai client.

The engine here is synthetic and declares no EOS token, so it cannot enforce constraints
(``docs/structured_outputs.md``): every constraint, in every spelling, must come back as a
400 naming the field the client used, including when the engine refuses only after a
wait (compiling off the event loop). Malformed and conflicting constraints, tool fields
without the server flags they need, and deprecated fields are refused the same way.
Constraints honoured end to end: ``test_server_structured_outputs.py``."""

from __future__ import annotations

import asyncio

import openai
import pytest

from pyengine import AsyncEngine
from pyengine.config import EngineConfig
from pyengine.engine.core import EngineCore
from pyengine.server import ServerArgs
from pyengine.testing.live_server import LiveServer
from pyengine.testing.synthetic_runner import SleepRunner

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
USER = [{"role": "user", "content": "Hello"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def engine():
    # No EOS token: constraints cannot be enforced (and are refused by the engine).
    engine = AsyncEngine.from_engine_core(EngineCore(EngineConfig(max_num_seqs=8), runner=SleepRunner(0.0)))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(engine):
    args = ServerArgs(model_name="m", chat_template=TEMPLATE, stats_interval=0, log_requests=False)
    with LiveServer(engine, args) as server:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=30, max_retries=0) as c:
            yield c


def refused(call, param: str) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400
    assert info.value.param == param, info.value.body
    assert param.split(".")[0] in info.value.message
    return info.value


CONSTRAINTS = [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "response_format"),
    ({"extra_body": {"structured_outputs": {"json": SCHEMA}}}, "structured_outputs.json"),
    ({"extra_body": {"structured_outputs": {"regex": "[a-z]+"}}}, "structured_outputs.regex"),
    ({"extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}}, "structured_outputs.choice"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: \"a\""}}}, "structured_outputs.grammar"),
    ({"extra_body": {"structured_outputs": {"json_object": True}}}, "structured_outputs.json_object"),
    ({"extra_body": {"guided_json": SCHEMA}}, "guided_json"),
    ({"extra_body": {"guided_json": '{"type": "object"}'}}, "guided_json"),
    ({"extra_body": {"guided_regex": "[0-9]+"}}, "guided_regex"),
    ({"extra_body": {"guided_choice": ["a", "b"]}}, "guided_choice"),
    ({"extra_body": {"guided_grammar": "root ::= \"a\""}}, "guided_grammar"),
]


@pytest.mark.parametrize("kwargs, param", CONSTRAINTS)
def test_chat_constraints_an_engine_cannot_enforce_are_refused_naming_the_field(client, kwargs, param):
    refused(lambda: client.chat.completions.create(model="m", messages=USER, max_tokens=4, **kwargs), param)


@pytest.mark.parametrize("kwargs, param", CONSTRAINTS[2:])
def test_completion_constraints_an_engine_cannot_enforce_are_refused_naming_the_field(client, kwargs, param):
    refused(lambda: client.completions.create(model="m", prompt="Hello", max_tokens=4, **kwargs), param)


def test_completion_response_format_is_refused(client):
    refused(lambda: client.completions.create(model="m", prompt="Hello", max_tokens=4,
                                              extra_body={"response_format": {"type": "json_object"}}),
            "response_format")


def test_streamed_constraints_are_refused_before_the_stream(client):
    refused(lambda: client.chat.completions.create(model="m", messages=USER, max_tokens=4, stream=True,
                                                   response_format={"type": "json_object"}), "response_format")


def test_malformed_constraints_name_their_field(client):
    for extra, param in [({"guided_choice": []}, "guided_choice"),
                         ({"guided_json": "{not json"}, "guided_json"),
                         ({"structured_outputs": {"json": "[1, 2"}}, "structured_outputs.json"),
                         ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
                         ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag")]:
        error = refused(lambda extra=extra: client.chat.completions.create(model="m", messages=USER, max_tokens=4,
                                                                           extra_body=extra), param)
        assert "structured_outputs" not in error.message or param.startswith("structured_outputs")


def test_malformed_constraints_name_their_part(client):
    refused(lambda: client.chat.completions.create(model="m", messages=USER, max_tokens=4,
                                                   response_format={"type": "xml"}), "response_format.type")
    refused(lambda: client.chat.completions.create(model="m", messages=USER, max_tokens=4,
                                                   response_format={"type": "json_schema"}),
            "response_format.json_schema")
    refused(lambda: client.chat.completions.create(model="m", messages=USER, max_tokens=4,
                                                   extra_body={"structured_outputs": {}}), "structured_outputs")


def test_two_constraints_at_once_are_refused(client):
    error = refused(lambda: client.chat.completions.create(
        model="m", messages=USER, max_tokens=4, response_format={"type": "json_object"},
        extra_body={"guided_regex": "a+"}), "guided_regex")
    assert error.code == "conflicting_constraints"


def test_tools_the_server_cannot_serve_are_refused_naming_tool_choice(client):
    # Without --enable-auto-tool-choice, "auto" (the default with tools) is refused; "required"
    # and a named function need constrained generation, which this engine cannot enforce:
    # refused too (naming the tools the constraint is made of), never free text.
    for choice in (None, "auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        kwargs = {} if choice is None else {"tool_choice": choice}
        error = refused(lambda kwargs=kwargs: client.chat.completions.create(
            model="m", messages=USER, max_tokens=4, tools=TOOLS, **kwargs),
            "tool_choice" if choice in (None, "auto") else "tools")
        if choice not in (None, "auto"):
            assert "cannot be enforced" in error.message


def test_tool_choice_without_tools_is_refused(client):
    refused(lambda: client.chat.completions.create(model="m", messages=USER, max_tokens=4, tool_choice="required"),
            "tool_choice")
    refused(lambda: client.chat.completions.create(model="m", messages=USER, max_tokens=4, tool_choice="always"),
            "tool_choice")


def test_deprecated_function_fields_are_refused(client):
    refused(lambda: client.chat.completions.create(model="m", messages=USER, max_tokens=4,
                                                   extra_body={"functions": [TOOLS[0]["function"]]}), "functions")
    refused(lambda: client.chat.completions.create(model="m", messages=USER, max_tokens=4,
                                                   extra_body={"function_call": "auto"}), "function_call")


def test_what_asks_for_nothing_is_served(client, engine):
    for kwargs in ({"response_format": {"type": "text"}}, {"tool_choice": "none"},
                   {"extra_body": {"tools": [], "ignore_eos": True}}):
        kwargs.setdefault("extra_body", {"ignore_eos": True})
        out = client.chat.completions.create(model="m", messages=USER, max_tokens=3, **kwargs)
        assert out.choices[0].finish_reason == "length"
        assert out.usage.completion_tokens == 3
    # Nothing refused above reached the engine: no request is left behind.
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0


class SlowToRefuse(AsyncEngine):
    """Refuses a constrained request only after a wait, as an engine that compiles the
    constraint elsewhere (in another process: ``prepare`` does nothing here) does."""

    async def prepare(self, sampling_params):
        return None

    async def generate(self, prompt, sampling_params=None, request_id=None, **kwargs):
        if sampling_params is not None and sampling_params.structured_outputs is not None:
            await asyncio.sleep(0.05)
        async for out in super().generate(prompt, sampling_params, request_id, **kwargs):
            yield out


def test_a_refusal_that_comes_late_is_still_a_400_for_a_stream():
    engine = SlowToRefuse.from_engine_core(EngineCore(EngineConfig(max_num_seqs=8), runner=SleepRunner(0.0)))
    args = ServerArgs(model_name="m", chat_template=TEMPLATE, stats_interval=0, log_requests=False)
    try:
        with LiveServer(engine, args) as server:
            with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=30, max_retries=0) as client:
                for stream in (True, False):
                    refused(lambda stream=stream: client.chat.completions.create(
                        model="m", messages=USER, max_tokens=4, stream=stream,
                        extra_body={"structured_outputs": {"regex": "(unclosed"}}), "structured_outputs.regex")
                    refused(lambda stream=stream: client.completions.create(
                        model="m", prompt=["a", "b"], max_tokens=4, stream=stream,
                        extra_body={"guided_regex": "(unclosed"}), "guided_regex")
                # Unconstrained requests are not held back.
                out = client.chat.completions.create(model="m", messages=USER, max_tokens=2, stream=True)
                assert sum(1 for _ in out) >= 2
        stats = engine.stats()
        assert stats.num_running == 0 and stats.num_waiting == 0
    finally:
        engine.shutdown()
