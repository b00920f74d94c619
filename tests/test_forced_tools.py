"""Forced tool calls without a parser, on their own (``pyengine/server/forced_tools.py``):
the schema a forced ``tool_choice`` compiles to (checked with ``jsonschema``, a validator
of its own), the ``$ref`` rewriting that keeps a tool's references pointing into its own
parameters once embedded, and the two answer formats read whole and in any pieces."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from pyengine.errors import InvalidRequestError
from pyengine.server.forced_tools import forced_tool_calls
from pyengine.server.tool_parsers import ParsedCall, parse_whole
from pyengine.server.tool_parsers.forced import call_schema
from pyengine.server.tool_parsers.schema_refs import embedded

TREE = {"type": "object", "properties": {"value": {"type": "integer"},
                                         "children": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["value"], "additionalProperties": False}
LINKED = {"type": "object", "properties": {"head": {"$ref": "#/$defs/Node"}}, "required": ["head"],
          "$defs": {"Node": {"type": "object", "properties": {"v": {"type": "string"},
                                                              "next": {"$ref": "#/$defs/Node"}},
                             "required": ["v"], "additionalProperties": False}}}
OLD_STYLE = {"type": "object", "properties": {"item": {"$ref": "#/definitions/Item"},
                                              "same": {"$ref": "#/properties/item"}},
             "definitions": {"Item": {"type": "integer", "minimum": 0}}}
FUNCTIONS = [{"name": "tree", "parameters": TREE}, {"name": "linked", "parameters": LINKED},
             {"name": "old", "parameters": OLD_STYLE}, {"name": "bare"}]
GOOD = {"tree": {"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}]},
        "linked": {"head": {"v": "a", "next": {"v": "b"}}},
        "old": {"item": 4, "same": 5}, "bare": {}}
BAD = {"tree": {"value": 1, "children": [{"value": "deep"}]},
       "linked": {"head": {"v": "a", "next": {"v": 7}}},
       "old": {"item": 4, "same": -5}}


def schema_of(grammar: str) -> dict:
    """The ``%json`` schema of a forced grammar (``start: %json {...}``)."""
    assert grammar.startswith("start: %json ")
    schema = json.loads(grammar[len("start: %json "):])
    schema.pop("x-guidance")
    return schema


def test_the_required_schema_is_an_array_of_calls_whose_refs_resolve_inside():
    schema = schema_of(forced_tool_calls(FUNCTIONS).grammar)
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    calls = [{"name": name, "parameters": args} for name, args in GOOD.items()]
    validator.validate(calls)
    for name, args in BAD.items():  # an error deep in a recursion is caught: the $ref points at the tool's own schema
        assert not validator.is_valid([{"name": name, "parameters": args}]), name
    assert not validator.is_valid([])  # "required": at least one call
    assert not validator.is_valid([{"name": "nope", "parameters": {}}])
    assert not validator.is_valid([{"name": "bare", "parameters": {}, "extra": 1}])


def test_parallel_false_allows_one_call_and_a_named_function_is_its_arguments():
    one = schema_of(forced_tool_calls(FUNCTIONS, parallel=False).grammar)
    assert jsonschema.Draft202012Validator(one).is_valid([{"name": "bare", "parameters": {}}])
    assert not jsonschema.Draft202012Validator(one).is_valid([{"name": "bare", "parameters": {}}] * 2)
    for name in ("tree", "linked", "old"):
        named = jsonschema.Draft202012Validator(schema_of(forced_tool_calls(FUNCTIONS, name).grammar))
        assert named.is_valid(GOOD[name]) and not named.is_valid(BAD[name]), name
    bare = schema_of(forced_tool_calls(FUNCTIONS, "bare").grammar)
    assert bare == {"type": "object", "properties": {}}  # no parameters: an empty object, as vLLM fills them


def test_a_parsers_call_schema_keeps_refs_inside_too():
    for key in ("arguments", "parameters"):
        schema = call_schema(FUNCTIONS, key)
        schema.pop("x-guidance")
        validator = jsonschema.Draft202012Validator(schema)
        for name, args in GOOD.items():
            assert validator.is_valid({"name": name, key: args}), name
        for name, args in BAD.items():
            assert not validator.is_valid({"name": name, key: args}), name


def test_embedded_moves_local_refs_only_and_leaves_data_alone():
    schema = {"properties": {"$ref": {"$ref": "#/$defs/a"}, "const": {"const": {"$ref": "#"}}},
              "items": [{"$ref": "#/"}, {"$ref": "other.json#/x"}, {"$ref": "#Node"}, {"$ref": "#"}],
              "default": {"$ref": "#"}}
    assert embedded(schema, "/p") == {
        "properties": {"$ref": {"$ref": "#/p/$defs/a"}, "const": {"const": {"$ref": "#"}}},
        "items": [{"$ref": "#/p"}, {"$ref": "other.json#/x"}, {"$ref": "#Node"}, {"$ref": "#/p"}],
        "default": {"$ref": "#"}}
    assert embedded(schema, "") == schema and embedded(schema, "") is not schema


def test_an_unknown_or_missing_function_is_an_invalid_request():
    with pytest.raises(InvalidRequestError, match="'nope' is not among the tools"):
        forced_tool_calls(FUNCTIONS, "nope")
    with pytest.raises(InvalidRequestError, match="at least one tool"):
        forced_tool_calls([])


ARRAY = ('[{"name": "tree", "parameters": {"value": 1, "children": [{"value": 2}]}}, '
         '{"name": "bare", "parameters": {}}, {"name": "linked", "parameters": {"head": {"v": "a \\" ] } ["}}}]')


def pieces(text: str, seed: int):
    rng = random.Random(seed)
    at = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
    return [text[a:b] for a, b in zip([0, *at], [*at, len(text)])]


def streamed(stream, parts):
    names, args, content = {}, {}, ""
    for step in [stream.feed(p) for p in parts] + [stream.finish()]:
        content += step.content
        for chunk in step.calls:
            if chunk.name is not None:
                assert chunk.index not in names
                names[chunk.index] = chunk.name
            assert chunk.index in names, "arguments come after the name"
            args[chunk.index] = args.get(chunk.index, "") + chunk.arguments
    return content, [ParsedCall(names[i], args.get(i, "")) for i in sorted(names)]


def test_the_array_reads_the_same_whole_and_in_any_pieces():
    forced = forced_tool_calls(FUNCTIONS)
    whole = forced.parse(ARRAY)
    assert [c.name for c in whole] == ["tree", "bare", "linked"]
    assert [json.loads(c.arguments) for c in whole] == [c["parameters"] for c in json.loads(ARRAY)]
    for seed in range(30):
        stream = forced.stream()
        content, calls = streamed(stream, pieces(ARRAY, seed))
        assert (content, calls) == ("", whole) and stream.has_valid_calls
    stream = forced.stream()
    assert streamed(stream, list(ARRAY))[1] == whole  # one character at a time


def test_an_unfinished_or_foreign_answer_is_no_calls():
    forced = forced_tool_calls(FUNCTIONS)
    for text in (ARRAY[:-1], ARRAY[:40], "", "hello", ARRAY + " and more", "[]x", "[1]"):
        assert forced.parse(text) is None, text
        assert parse_whole(forced.stream(), text).content == text  # returned as the text it is
    named = forced_tool_calls(FUNCTIONS, "tree")
    assert named.parse('{"value": 1, "children": [') is None


def test_a_named_function_streams_its_arguments_under_its_name():
    named = forced_tool_calls(FUNCTIONS, "tree")
    text = json.dumps(GOOD["tree"])
    assert named.parse(text) == [ParsedCall("tree", text)]
    for seed in range(10):
        stream = named.stream()
        assert streamed(stream, pieces(text, seed)) == ("", [ParsedCall("tree", text)])
        assert stream.has_valid_calls
