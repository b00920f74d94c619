"""From request fields to the engine's ``StructuredOutputsParams`` (``server/structured.py``)
and to the grammar that forces tool calls (``server/tools.py``, the parsers'
``forced_grammar``): every spelling a client may use lands on the same constraint, with
its options, and errors name the field the client sent."""

from __future__ import annotations

import json

import pytest

from pyengine.server.errors import APIError, bad_request
from pyengine.server.protocol import ChatCompletionRequest, CompletionRequest
from pyengine.server.structured import name_constraint_error, structured_outputs_params
from pyengine.server.tool_parsers import TOOL_PARSERS
from pyengine.server.tools import tool_plan
from pyengine.structured_outputs import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time"}}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


@pytest.mark.parametrize("fields, expected, param", [
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True), "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     StructuredOutputsParams(json=SCHEMA), "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA, disable_additional_properties=True), "response_format"),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True, "whitespace_pattern": " ?"}},
     StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True, whitespace_pattern=" ?"),
     "structured_outputs.json"),
    ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputsParams(regex="[a-z]+"), "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputsParams(choice=["yes", "no"]),
     "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": 'start: "a"+'}}, StructuredOutputsParams(grammar='start: "a"+'),
     "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputsParams(json_object=True),
     "structured_outputs.json_object"),
    ({"guided_json": json.dumps(SCHEMA), "guided_whitespace_pattern": "[ ]?"},
     StructuredOutputsParams(json=json.dumps(SCHEMA), whitespace_pattern="[ ]?"), "guided_json"),
    ({"guided_regex": "[0-9]{3}"}, StructuredOutputsParams(regex="[0-9]{3}"), "guided_regex"),
    ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"]), "guided_choice"),
    ({"guided_grammar": 'start: "x"'}, StructuredOutputsParams(grammar='start: "x"'), "guided_grammar"),
    ({"response_format": {"type": "text"}}, None, None),
    ({"guided_decoding_backend": "xgrammar"}, None, None),
])
def test_every_spelling_maps_to_the_engines_constraint(fields, expected, param):
    assert structured_outputs_params(chat(**fields)) == (expected, param)
    if not fields.get("response_format"):  # completions take vLLM's spellings too
        assert structured_outputs_params(CompletionRequest.model_validate({"prompt": "x", **fields})) == \
            (expected, param)


def test_engine_errors_are_named_by_the_field_the_client_sent():
    compiler = bad_request("invalid regex: unclosed group")
    named = name_constraint_error(compiler, "guided_regex")
    assert (named.param, named.message) == ("guided_regex", "guided_regex: invalid regex: unclosed group")
    checks = bad_request("structured_outputs.json is not valid JSON: Expecting value")
    named = name_constraint_error(checks, "response_format")
    assert (named.param, named.message) == ("response_format", "response_format is not valid JSON: Expecting value")
    assert name_constraint_error(checks, "structured_outputs.json").message == checks.message
    named_already = bad_request("max_tokens must be >= 1", "max_tokens")
    assert name_constraint_error(named_already, "guided_json") is named_already
    server = APIError(500, "internal server error (reference x)")
    assert name_constraint_error(server, "guided_json") is server
    assert name_constraint_error(compiler, None) is compiler


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_forced_tool_choice_becomes_a_grammar_in_the_parsers_format(parser):
    required = tool_plan(chat(tools=TOOLS, tool_choice="required"), parser, auto_enabled=False)
    assert required.parser == parser and required.max_calls is None
    assert required.structured_outputs() == StructuredOutputsParams(grammar=required.grammar)
    assert '"get_weather"' in required.grammar and '"get_time"' in required.grammar
    assert required.grammar.startswith("start: call (")  # one call or more

    single = tool_plan(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), parser, False)
    assert single.max_calls == 1 and single.grammar.startswith("start: call\n")

    named = tool_plan(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}),
                      parser, False)
    assert named.max_calls == 1 and '"get_time"' in named.grammar and "get_weather" not in named.grammar
    # The tool's parameters are embedded as its arguments' schema.
    assert json.dumps(SCHEMA) in required.grammar


def test_the_forced_grammar_embeds_each_tools_schema_under_the_formats_key():
    hermes = TOOL_PARSERS["hermes"].forced_grammar([{"name": "f", "parameters": SCHEMA}], many=False)
    body = json.loads(hermes.split("%json ", 1)[1])
    assert body == {"type": "object", "properties": {"name": {"const": "f"}, "arguments": SCHEMA},
                    "required": ["name", "arguments"], "additionalProperties": False,
                    "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    assert '"<tool_call>\\n" body "\\n</tool_call>"' in hermes
    llama = TOOL_PARSERS["llama3_json"].forced_grammar([{"name": "f"}, {"name": "g", "parameters": SCHEMA}], True)
    schema = json.loads(llama.split("%json ", 1)[1])
    assert [o["properties"]["name"]["const"] for o in schema["anyOf"]] == ["f", "g"]
    assert schema["anyOf"][0]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert '("; " call)*' in llama


def test_forced_tool_choice_without_a_parser_takes_vllms_format_and_needs_a_known_name():
    required = tool_plan(chat(tools=TOOLS, tool_choice="required"), None, False)
    assert required.grammar.startswith('start: %json {"x-guidance"') and '"type": "array"' in required.grammar
    assert required.forced is not None and not required.named and required.parser is None
    named = tool_plan(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}), None,
                      False)
    assert named.named and named.forced.name == "get_time" and named.max_calls == 1
    with pytest.raises(APIError) as info:
        tool_plan(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), None, False)
    assert info.value.param == "tool_choice.function.name"
    with pytest.raises(APIError) as info:
        tool_plan(chat(tools=TOOLS, tool_choice={"type": "retrieval", "function": {"name": "get_time"}}), "hermes",
                  False)
    assert info.value.param == "tool_choice.type"
