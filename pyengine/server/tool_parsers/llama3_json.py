"""``llama3_json``: Llama 3.1 / 3.2's JSON tool calls. An answer that starts with a JSON
object (after ``<|python_tag|>``, when special tokens are kept) is tool calls::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

several of them separated by ``;``; ``"arguments"`` is accepted for ``"parameters"``. An
answer that starts with anything else is content, all of it. After the calls, anything
but whitespace and ``;`` makes the answer malformed (``parse_whole`` then returns the
text); streamed, it is passed on as content."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, ClassVar, Optional

from pyengine.server.tool_parsers.base import ParseStep, ToolCallStream
from pyengine.server.tool_parsers.forced import call_schema, calls_grammar
from pyengine.server.tool_parsers.hermes import held_prefix
from pyengine.server.tool_parsers.json_scan import CallBody, JsonValueScanner

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolCallStream(ToolCallStream):
    keeps_special_tokens: ClassVar[bool] = False  # the JSON needs no tag; <|python_tag|> may go

    def __init__(self, max_calls: Optional[int] = None) -> None:
        super().__init__(max_calls)
        self._pending = ""
        self._mode: Optional[str] = None  # None: undecided, "content" or "calls"
        self._body: Optional[CallBody] = None
        self._object: Optional[JsonValueScanner] = None
        self.trailing_text = False  # text that is neither a call nor a separator followed the calls

    @classmethod
    def forced_grammar(cls, functions: Sequence[dict[str, Any]], many: bool) -> str:
        """``{"name": ..., "parameters": ...}``, calls separated by ``; ``."""
        schema = json.dumps(call_schema(functions, "parameters"), ensure_ascii=False)
        return calls_grammar(f"call: %json {schema}\n", "; ", many)

    def feed(self, text: str) -> ParseStep:
        self._pending += text
        step = ParseStep()
        if self._mode is None:
            self._decide()
        if self._mode == "content":
            step.content += self._pending
            self._pending = ""
        elif self._mode == "calls":
            self._read_calls(step)
        return step

    def _decide(self) -> None:
        head = self._pending.lstrip()
        if head.startswith(PYTHON_TAG):
            self._mode, self._pending = "calls", head[len(PYTHON_TAG):]
        elif head.startswith("{"):
            self._mode, self._pending = "calls", head
        elif head and not (held_prefix(head, PYTHON_TAG) == len(head)):
            self._mode = "content"

    def _read_calls(self, step: ParseStep) -> None:
        while self._pending:
            if self._body is None:
                rest = self._pending.lstrip().lstrip(";").lstrip()
                if not rest:
                    self._pending = ""
                    return
                if not rest.startswith("{"):
                    self.trailing_text = True
                    self._mode = "content"
                    step.content += rest
                    self._pending = ""
                    return
                self._pending = rest
                self._body, self._object = self._open_call(), JsonValueScanner()
            assert self._object is not None
            _, used = self._object.feed(self._pending)
            piece, self._pending = self._pending[:used], self._pending[used:]
            events = self._body.feed(piece)
            step.calls += self._report(self._body, events.name, events.arguments)
            if self._object.done:
                body, self._body = self._body, None
                events = body.close()
                step.calls += self._report(body, events.name, events.arguments)

    def finish(self) -> ParseStep:
        step = ParseStep()
        if self._mode is None:  # whitespace only, or a lone start of <|python_tag|>
            step.content, self._pending = self._pending, ""
        return step

    @property
    def valid(self) -> bool:
        return super().valid and not self.trailing_text
