"""The Responses API's stream: typed events, each with its ``sequence_number`` (0, 1, ...),
sent as ``event: <type>`` / ``data: <json>`` pairs (no ``[DONE]``, as OpenAI and vLLM).

In order: ``response.created``, ``response.in_progress``; then per output item
``response.output_item.added``, for a message ``response.content_part.added``, its
``response.output_text.delta``\\ s, ``response.output_text.done`` and
``response.content_part.done``, for a function call its
``response.function_call_arguments.delta``\\ s and ``.done``; ``response.output_item.done``;
and last ``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut
the answer), carrying the whole response. A failure once the stream has started is a
``response.failed`` carrying the error.

With a tool-call parser, text and calls are told apart as the parser finds them
(``tools.StreamedToolCalls``, as on chat): text opens a message item, a call's first
piece closes the open item and opens a ``function_call`` item. Within one parser step the
arguments that continue an open call go first (they precede any text of that step), so a
call's ``.done`` events carry all its arguments.

A call the parser saw open but that turned out malformed or was cut (``max_output_tokens``)
has had its events sent; the whole answer then is text, as the non-streamed response says,
so ``final_items`` gives the closing event (and the store) the whole-text parse instead."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pyengine.server.responses.output import new_item_id, output_items
from pyengine.server.responses.protocol import FunctionCallItem, OutputItem, OutputMessage, OutputText
from pyengine.server.sse import typed_event
from pyengine.server.tools import StreamedToolCalls, ToolPlan


@dataclass
class EventWriter:
    """Numbers the events of one stream."""

    sequence_number: int = 0

    def emit(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return typed_event(kind, data)


@dataclass
class StreamedOutput:
    """The output items of one streamed response, built from its text deltas; each call
    returns the events to send. ``items`` holds the items closed so far."""

    plan: ToolPlan
    writer: EventWriter
    items: list[OutputItem] = field(default_factory=list)
    _open: Union[OutputMessage, FunctionCallItem, None] = None
    _calls: dict[int, FunctionCallItem] = field(default_factory=dict)
    _parser: Optional[StreamedToolCalls] = None

    def __post_init__(self) -> None:
        stream = self.plan.stream()
        self._parser = StreamedToolCalls(stream) if stream is not None else None

    def feed(self, text: str, finished: bool) -> list[bytes]:
        if self._parser is None:
            return self._text(text)
        content, calls = self._parser.delta(text, finished)
        calls = calls or []
        out: list[bytes] = []
        for call in calls:  # arguments continuing a call opened in an earlier step
            if call.id is None and call.function is not None and call.function.arguments:
                out += self._arguments(call.index, call.function.arguments)
        out += self._text(content or "")
        for call in calls:
            if call.id is not None:
                name = call.function.name if call.function is not None else ""
                out += self._start_call(call.index, call.id, name or "")
                if call.function is not None and call.function.arguments:
                    out += self._arguments(call.index, call.function.arguments)
        return out

    def final_items(self, text: str) -> list[OutputItem]:
        """The output the closing event carries and the store keeps, once ``close`` ran:
        the streamed items, unless a streamed call is not a valid one (malformed, or cut
        by ``max_output_tokens``); then the whole answer ``text`` read as the non-streamed
        response reads it (plain text), so that a follow-up's history never holds a call
        with broken arguments."""
        streamed_calls = any(isinstance(item, FunctionCallItem) for item in self.items)
        if self._parser is None or not streamed_calls or self._parser.called:
            return self.items
        return output_items(self.plan, text)

    def close(self) -> list[bytes]:
        """The events that close the open item, if any."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.items)
        self.items.append(item)
        emit = self.writer.emit
        if isinstance(item, OutputMessage):
            item.status = "completed"
            part = item.content[0]
            return [emit("response.output_text.done", item_id=item.id, output_index=index, content_index=0,
                         text=part.text, logprobs=[]),
                    emit("response.content_part.done", item_id=item.id, output_index=index, content_index=0,
                         part=part.model_dump()),
                    emit("response.output_item.done", output_index=index, item=item.model_dump())]
        item.status = "completed"
        return [emit("response.function_call_arguments.done", item_id=item.id, output_index=index,
                     name=item.name, arguments=item.arguments),
                emit("response.output_item.done", output_index=index, item=item.model_dump())]

    def _text(self, text: str) -> list[bytes]:
        if not text:
            return []
        out: list[bytes] = []
        emit, index = self.writer.emit, len(self.items)
        if not isinstance(self._open, OutputMessage):
            out += self.close()
            index = len(self.items)
            message = OutputMessage(id=new_item_id("msg"), status="in_progress", content=[])
            out.append(emit("response.output_item.added", output_index=index, item=message.model_dump()))
            message.content.append(OutputText(text=""))
            out.append(emit("response.content_part.added", item_id=message.id, output_index=index,
                            content_index=0, part=message.content[0].model_dump()))
            self._open = message
        self._open.content[0].text += text
        out.append(emit("response.output_text.delta", item_id=self._open.id, output_index=index, content_index=0,
                        delta=text, logprobs=[]))
        return out

    def _start_call(self, call_index: int, call_id: str, name: str) -> list[bytes]:
        out = self.close()
        item = FunctionCallItem(id=new_item_id("fc"), call_id=call_id, name=name, arguments="", status="in_progress")
        self._calls[call_index] = item
        self._open = item
        out.append(self.writer.emit("response.output_item.added", output_index=len(self.items),
                                    item=item.model_dump()))
        return out

    def _arguments(self, call_index: int, delta: str) -> list[bytes]:
        item = self._calls.get(call_index)
        if item is None:
            return []
        item.arguments += delta
        if item is not self._open:  # a call already closed (parsers write calls one after the other)
            return []
        return [self.writer.emit("response.function_call_arguments.delta", item_id=item.id,
                                 output_index=len(self.items), delta=delta)]
