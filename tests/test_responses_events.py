"""``StreamedOutput``, the Responses stream's items, fed text deltas through the hermes
parser directly: a call's ``.done`` events carry all its arguments even when its end and
the text after it come in one delta, and a call that is cut (or malformed) leaves the final
response (what the store keeps) the non-streamed one: the whole text, no broken call."""

from __future__ import annotations

import json

from pyengine.server.responses.conversation import output_messages
from pyengine.server.responses.events import EventWriter, StreamedOutput
from pyengine.server.responses.output import output_items
from pyengine.server.tools import ToolPlan

PLAN = ToolPlan(parser="hermes")


def stream(deltas: list[str]) -> tuple[StreamedOutput, list[dict]]:
    output = StreamedOutput(PLAN, EventWriter())
    raw = []
    for i, delta in enumerate(deltas):
        raw += output.feed(delta, i == len(deltas) - 1)
    raw += output.close()
    events = [json.loads(event.decode().split("\n")[1].removeprefix("data: ")) for event in raw]
    return output, events


def test_a_calls_end_and_the_text_after_it_in_one_delta():
    deltas = ['Hi <tool_call>{"name": "f", "arguments": {"a": ', '1}}</tool_call> bye', ""]
    output, events = stream(deltas)
    [message, call, after] = output.final_items("".join(deltas))
    assert call.arguments == '{"a": 1}' and after.content[0].text == " bye"
    sent = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    [done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert sent == done["arguments"] == call.arguments
    [item_done] = [e for e in events if e["type"] == "response.output_item.done" and e["output_index"] == 1]
    assert item_done["item"]["arguments"] == call.arguments


def test_a_cut_call_is_the_whole_text_as_the_non_streamed_response_says():
    deltas = ['Hi <tool_call>{"name": "f", "arguments": {"a": ', "1"]
    text = "".join(deltas)
    output, events = stream(deltas)
    assert any(e["type"] == "response.function_call_arguments.delta" for e in events), "streamed as a call"
    final = output.final_items(text)
    whole = output_items(PLAN, text)
    assert [item.model_dump(exclude={"id"}) for item in final] == [item.model_dump(exclude={"id"}) for item in whole]
    [message] = final
    assert message.type == "message" and message.content[0].text == text
    # What the store keeps renders as a follow-up's history (a broken call would be a 400).
    [turn] = output_messages(final)
    assert "tool_calls" not in turn and turn["content"] == text


def test_valid_calls_keep_the_streamed_items():
    deltas = ['<tool_call>{"name": "f", "arguments": {}}</tool_call>', ""]
    output, _ = stream(deltas)
    assert output.final_items("".join(deltas)) is output.items
