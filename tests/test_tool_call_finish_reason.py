"""A streamed chat answer and the same answer whole agree on ``finish_reason``: both say
"tool_calls" only for calls that are all valid. A call that is reported while streaming
and turns out malformed at the end makes both say "stop"."""

from __future__ import annotations

import pytest

from pyengine.server.tools import StreamedToolCalls, ToolPlan, whole_message

VALID = {
    "hermes": '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
    "llama3_json": '{"name": "f", "parameters": {"a": 1}}',
}
MALFORMED_AFTER_A_NAME = [  # the name is reported (and streamed) before the call goes bad
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}} trailing}</tool_call>'),
    ("hermes", '<tool_call>{"name": "ok", "arguments": {}}</tool_call><tool_call>{"name": "bad", "arguments": {</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1'),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1,}}'),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}} and then some words'),
]


def streamed_finish(plan: ToolPlan, text: str, reason: str, piece: int) -> tuple[str, bool]:
    """(the last chunk's finish_reason, whether any tool-call delta was sent) for ``text``
    streamed in ``piece``-character deltas, as chat.py's stream builds them."""
    parser = StreamedToolCalls(plan.stream())
    pieces = [text[i:i + piece] for i in range(0, len(text), piece)]
    sent_calls = False
    for i, p in enumerate(pieces):
        _, calls = parser.delta(p, finished=i == len(pieces) - 1)
        sent_calls = sent_calls or bool(calls)
    return plan.finish_reason(parser.called, reason), sent_calls


@pytest.mark.parametrize("parser,text", MALFORMED_AFTER_A_NAME)
@pytest.mark.parametrize("piece", [1, 7, 10_000])
def test_a_malformed_call_stops_both_ways(parser, text, piece):
    plan = ToolPlan(tools=[{"type": "function", "function": {"name": "f"}}], parser=parser)
    message, whole_reason = whole_message(plan, text, "stop")
    assert message.tool_calls is None and message.content == text
    stream_reason, sent_calls = streamed_finish(plan, text, "stop", piece)
    assert whole_reason == stream_reason == "stop"
    if piece == 1:
        assert sent_calls  # the stream had reported the call: the case the two used to disagree on


@pytest.mark.parametrize("parser", sorted(VALID))
@pytest.mark.parametrize("reason", ["stop", "length"])
def test_valid_calls_agree_both_ways(parser, reason):
    plan = ToolPlan(tools=[{"type": "function", "function": {"name": "f"}}], parser=parser)
    message, whole_reason = whole_message(plan, VALID[parser], reason)
    assert [c.function.name for c in message.tool_calls] == ["f"]
    assert streamed_finish(plan, VALID[parser], reason, 3)[0] == whole_reason
    assert whole_reason == ("tool_calls" if reason == "stop" else "length")
    named = ToolPlan(tools=plan.tools, parser=parser, named=True)
    assert whole_message(named, VALID[parser], "stop")[1] == streamed_finish(named, VALID[parser], "stop", 3)[0] == "stop"
