"""The tool-call parsers on their own (``pyengine/server/tool_parsers``): the formats they
read, what they refuse, and that a text streamed in any pieces gives what the whole text
gives (the server uses the same code for both)."""

from __future__ import annotations

import json
import random

import pytest

from pyengine.server.tool_parsers import TOOL_PARSERS, ParsedCall, parse_whole, tool_call_stream

WEATHER = {"city": "Paris", "days": [1, 2], "note": "a } and a \" and a \\\\ and 你好"}
HERMES_TWO = (
    "Let me check.\n"
    f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(WEATHER, ensure_ascii=False)}}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
)


def streamed(name: str, pieces: list[str], max_calls=None):
    """(content, [(name, arguments)], stream) from feeding ``pieces`` one by one."""
    stream = tool_call_stream(name, max_calls)
    content, names, args = "", {}, {}
    steps = [stream.feed(p) for p in pieces] + [stream.finish()]
    for step in steps:
        content += step.content
        for chunk in step.calls:
            if chunk.name is not None:
                assert chunk.index not in names, "a call's name is reported once"
                names[chunk.index] = chunk.name
            assert chunk.index in names, "arguments come after the name"
            args[chunk.index] = args.get(chunk.index, "") + chunk.arguments
    return content, [(names[i], args.get(i, "")) for i in sorted(names)], stream


def splits(text: str, seed: int = 0):
    """The text in one piece, character by character, at every single cut, and in random pieces."""
    yield [text]
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    rng = random.Random(seed)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), 5))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_the_registry_has_vllms_names():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json"}
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        tool_call_stream("mistral")


# ---- hermes ----

def test_hermes_reads_calls_and_content():
    parsed = parse_whole(tool_call_stream("hermes"), HERMES_TWO)
    assert parsed.content == "Let me check.\n"
    assert [c.name for c in parsed.calls] == ["get_weather", "get_time"]
    assert json.loads(parsed.calls[0].arguments) == WEATHER
    assert json.loads(parsed.calls[1].arguments) == {}


@pytest.mark.parametrize("name, text", [
    ("hermes", HERMES_TWO),
    ("hermes", 'Plain answer, <b>no</b> tools, < tool_call >.\n'),
    ("hermes", '<tool_call>{"arguments": {"a": [1, 2]}, "name": "reordered"}</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"x": "}{", "y": [true, null, 1.5]}}; {"name": "g", "parameters": {}}'),
    ("llama3_json", "Just text, {not a call} at the start."),
])
def test_any_split_gives_what_the_whole_text_gives(name, text):
    whole = parse_whole(tool_call_stream(name), text)
    for pieces in splits(text):
        content, calls, stream = streamed(name, pieces)
        assert stream.valid
        if whole.calls:
            assert calls == [(c.name, c.arguments) for c in whole.calls], pieces
            assert (content or None) == whole.content, pieces
        else:
            assert calls == [] and content == text, pieces


def test_hermes_streams_arguments_as_they_are_written():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>'
    stream = tool_call_stream("hermes")
    seen = []
    for ch in text:
        for chunk in stream.feed(ch).calls:
            seen.append(chunk)
    assert seen[0].name == "get_weather" and seen[0].arguments == ""
    arguments = [c.arguments for c in seen[1:]]
    assert len(arguments) > 5, "arguments arrive in many pieces, not at the end"
    assert "".join(arguments) == '{"city": "Paris", "days": 3}'


def test_hermes_keys_in_another_order_are_reported_at_the_close():
    content, calls, stream = streamed("hermes", list('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>'))
    assert calls == [("f", '{"a": 1}')] and stream.valid and content == ""


def test_whitespace_around_calls_is_no_content_but_text_is():
    assert parse_whole(tool_call_stream("hermes"), '\n\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n') \
        .content is None
    parsed = parse_whole(tool_call_stream("hermes"), '<tool_call>{"name": "f", "arguments": {}}</tool_call> Done.')
    assert parsed.content == " Done."
    # Without calls the text is kept whole, whitespace included.
    assert parse_whole(tool_call_stream("hermes"), "  \n").content == "  \n"


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "f", "arguments": {"a": 1',  # cut short (max_tokens)
    '<tool_call>{"name": "f", "arguments": {"a": 1}}',  # never closed
    "<tool_call>not json</tool_call>",
    '<tool_call>{"name": "f", "arguments": {"a": 1}} trailing}</tool_call>',
    '<tool_call>["f"]</tool_call>',
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "ok", "arguments": {}}</tool_call><tool_call>{"name": "bad", "arguments": {</tool_call>',
])
def test_hermes_malformed_or_cut_calls_leave_the_text_as_it_is(text):
    parsed = parse_whole(tool_call_stream("hermes"), text)
    assert parsed == type(parsed)(text, [])


def test_hermes_max_calls_keeps_the_first():
    content, calls, _ = streamed("hermes", [HERMES_TWO], max_calls=1)
    assert [name for name, _ in calls] == ["get_weather"]
    parsed = parse_whole(tool_call_stream("hermes", 1), HERMES_TWO)
    assert [c.name for c in parsed.calls] == ["get_weather"] and parsed.content == "Let me check.\n"


# ---- llama3_json ----

def test_llama3_reads_one_or_several_calls():
    parsed = parse_whole(tool_call_stream("llama3_json"),
                         '{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert parsed.content is None
    assert parsed.calls == [ParsedCall("get_weather", '{"city": "Paris"}')]
    parsed = parse_whole(tool_call_stream("llama3_json"),
                         '<|python_tag|>{"name": "a", "arguments": {"x": 1}}; {"name": "b", "parameters": {}}')
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("a", {"x": 1}), ("b", {})]


def test_llama3_text_that_does_not_start_with_a_call_is_content():
    for text in ("The weather is fine.", ' I think {"name": "f", "parameters": {}}', ""):
        assert parse_whole(tool_call_stream("llama3_json"), text).calls == []


@pytest.mark.parametrize("text", [
    '{"name": "f", "parameters": {"a": 1}} and then some words',
    '{"name": "f", "parameters": {"a": 1}',
    '{"parameters": {"a": 1}}',
    '{"name": "f", "parameters": {"a": 1,}}',
])
def test_llama3_malformed_calls_leave_the_text_as_it_is(text):
    parsed = parse_whole(tool_call_stream("llama3_json"), text)
    assert parsed.calls == [] and parsed.content == text


def test_the_parsing_benchmark_runs():
    """``benches/tool_parsers.py`` cannot rot: one quick run, every parser measured."""
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benches" / "tool_parsers.py"
    done = subprocess.run([sys.executable, str(bench), "--json", "--repeats", "1"], capture_output=True, text=True,
                          timeout=120, check=True)
    results = json.loads(done.stdout)
    assert set(results) == set(TOOL_PARSERS)
    assert all(r["pieces"] > 1000 and r["us_per_piece"] > 0 for r in results.values())
