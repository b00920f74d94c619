"""``hermes``: Hermes 2 Pro and Qwen 2.5 / Qwen 3's format, each call wrapped in tags::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is content. A call's name is reported as soon as it is written and
its arguments as they are generated; a call still open when the text ends (cut by
``max_tokens``) or whose body is not a call's JSON makes the whole answer text
(``parse_whole``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, ClassVar, Optional

from pyengine.server.tool_parsers.base import ParseStep, ToolCallStream
from pyengine.server.tool_parsers.forced import call_schema, calls_grammar, lark_literal
from pyengine.server.tool_parsers.json_scan import CallBody

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag`` (kept
    back until the next piece tells)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesToolCallStream(ToolCallStream):
    #: The tags may be special tokens in some tokenizers: the text must keep them.
    keeps_special_tokens: ClassVar[bool] = True

    def __init__(self, max_calls: Optional[int] = None) -> None:
        super().__init__(max_calls)
        self._pending = ""
        self._body: Optional[CallBody] = None

    @classmethod
    def forced_grammar(cls, functions: Sequence[dict[str, Any]], many: bool) -> str:
        """``<tool_call>\n{json}\n</tool_call>``, calls separated by a newline (as Qwen
        writes them)."""
        schema = json.dumps(call_schema(functions, "arguments"), ensure_ascii=False)
        call = f"call: {lark_literal(OPEN + chr(10))} body {lark_literal(chr(10) + CLOSE)}\nbody: %json {schema}\n"
        return calls_grammar(call, "\n", many)

    def feed(self, text: str) -> ParseStep:
        self._pending += text
        step = ParseStep()
        while True:
            if self._body is None:
                at = self._pending.find(OPEN)
                if at < 0:
                    cut = len(self._pending) - held_prefix(self._pending, OPEN)
                    step.content += self.outside.add(self._pending[:cut])
                    self._pending = self._pending[cut:]
                    return step
                step.content += self.outside.add(self._pending[:at])
                step.content += self.outside.end(keep_whitespace=False)
                self._pending = self._pending[at + len(OPEN):]
                self._body = self._open_call()
            else:
                at = self._pending.find(CLOSE)
                if at < 0:
                    cut = len(self._pending) - held_prefix(self._pending, CLOSE)
                    self._feed_body(step, self._pending[:cut])
                    self._pending = self._pending[cut:]
                    return step
                self._feed_body(step, self._pending[:at])
                body, self._body = self._body, None
                events = body.close()
                step.calls += self._report(body, events.name, events.arguments)
                self._pending = self._pending[at + len(CLOSE):]

    def _feed_body(self, step: ParseStep, piece: str) -> None:
        if self._body is not None and piece:
            events = self._body.feed(piece)
            step.calls += self._report(self._body, events.name, events.arguments)

    def finish(self) -> ParseStep:
        step = ParseStep()
        if self._body is not None:  # cut short: the call stays incomplete (not valid)
            self._feed_body(step, self._pending)
        else:
            step.content += self.outside.add(self._pending)
        self._pending = ""
        step.content += self.outside.end(keep_whitespace=not self.bodies)
        return step
