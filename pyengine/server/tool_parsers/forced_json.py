"""The two formats of a forced tool call on a server without ``--tool-call-parser``, as
vLLM constrains them (``pyengine/server/forced_tools.py`` chooses one):

- ``tool_choice="required"``: a JSON array of calls,
  ``[{"name": "get_weather", "parameters": {"city": "Paris"}}, ...]`` (at least one);
- a named function: that function's arguments alone, ``{"city": "Paris"}``.

Each is a ``ToolCallStream`` like the model formats' parsers, so a streamed and a whole
answer are read by the same code and streamed as the same deltas: a call's name as soon
as it is known, then its arguments' text as written. The grammar (``forced_grammar``)
writes JSON as templates do (``, `` and ``: ``, no other whitespace), so the arguments
passed on are what ``json.dumps`` would write of them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, ClassVar, Optional

from pyengine.server.tool_parsers.base import ParseStep, ToolCallStream
from pyengine.server.tool_parsers.forced import AS_TEMPLATES_WRITE_JSON, one_of_calls
from pyengine.server.tool_parsers.json_scan import CallBody, JsonValueScanner
from pyengine.server.tool_parsers.schema_refs import embedded


def _grammar(schema: dict[str, Any]) -> str:
    return f"start: %json {json.dumps(schema, ensure_ascii=False)}\n"


class JsonArrayToolCallStream(ToolCallStream):
    """``[{"name": ..., "parameters": ...}, ...]``: the whole answer is the array (text
    before it, after it, or an array left open makes the answer malformed, returned as
    text by ``parse_whole``)."""

    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, max_calls: Optional[int] = None) -> None:
        super().__init__(max_calls)
        self._text = ""
        self._pending = ""
        self._state = "start"  # start -> items <-> call -> end; or content (malformed)
        self._body: Optional[CallBody] = None
        self._object: Optional[JsonValueScanner] = None
        self._whole: Optional[bool] = None  # the closed array checked with json.loads

    @classmethod
    def forced_grammar(cls, functions: Sequence[dict[str, Any]], many: bool) -> str:
        """One call or more of ``functions`` (``many``), else exactly one, in an array."""
        schema: dict[str, Any] = {"x-guidance": AS_TEMPLATES_WRITE_JSON, "type": "array", "minItems": 1}
        if not many:
            schema["maxItems"] = 1
        schema["items"] = one_of_calls(functions, "parameters", "/items")
        return _grammar(schema)

    def feed(self, text: str) -> ParseStep:
        self._text += text
        self._pending += text
        step = ParseStep()
        while self._pending:
            if self._state == "call":
                self._read_call(step)
                continue
            if self._state == "content":
                step.content, self._pending = step.content + self._pending, ""
                break
            rest = self._pending.lstrip()
            if not rest:
                self._pending = ""
                break
            self._pending = rest
            self._next_state(rest[0])
        return step

    def _next_state(self, head: str) -> None:
        """Between calls: what ``head`` (the next character that is not whitespace) starts."""
        if self._state == "start" and head == "[":
            self._state, self._pending = "items", self._pending[1:]
        elif self._state == "items" and head in ",]":
            self._state = "end" if head == "]" else "items"
            self._pending = self._pending[1:]
        elif self._state == "items" and head == "{":
            self._state, self._body, self._object = "call", self._open_call(), JsonValueScanner()
        else:  # anything else, and anything after the array, is not calls
            self._state = "content"

    def _read_call(self, step: ParseStep) -> None:
        assert self._body is not None and self._object is not None
        _, used = self._object.feed(self._pending)
        piece, self._pending = self._pending[:used], self._pending[used:]
        events = self._body.feed(piece)
        step.calls += self._report(self._body, events.name, events.arguments)
        if self._object.done:
            body, self._body, self._state = self._body, None, "items"
            events = body.close()
            step.calls += self._report(body, events.name, events.arguments)

    def finish(self) -> ParseStep:
        return ParseStep()

    @property
    def valid(self) -> bool:
        """Every call well-formed, and the answer one closed JSON array of them."""
        if self._state != "end":
            return False
        if self._whole is None:
            try:
                self._whole = isinstance(json.loads(self._text), list)
            except ValueError:
                self._whole = False
        return self._whole and super().valid


class NamedArgumentsToolCallStream(ToolCallStream):
    """The arguments of the one function the client named: the whole answer is one call
    of ``name``, whose arguments are the answer's text (reported as it streams, checked
    with ``json.loads`` at the end)."""

    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, name: str) -> None:
        super().__init__(1)
        self.name = name
        self._text = ""

    @classmethod
    def forced_grammar(cls, functions: Sequence[dict[str, Any]], many: bool) -> str:
        """The arguments of the one function in ``functions`` (``many`` must be false)."""
        if len(functions) != 1 or many:
            raise ValueError("a named function's grammar is for exactly one call of one function")
        parameters = functions[0].get("parameters") or {"type": "object", "properties": {}}
        return _grammar({"x-guidance": AS_TEMPLATES_WRITE_JSON, **embedded(parameters, "")})

    def feed(self, text: str) -> ParseStep:
        self._text += text
        step = ParseStep()
        if not self.bodies:
            if not text.strip():
                return step
            body = self._open_call()
            body.name = self.name
            text = text.lstrip()
            body.arguments = text
            step.calls += self._report(body, self.name, text)
            return step
        body = self.bodies[0]
        body.arguments += text
        step.calls += self._report(body, None, text)
        return step

    def finish(self) -> ParseStep:
        if self.bodies:
            body = self.bodies[0]
            try:
                json.loads(self._text)
                body.valid = True
            except ValueError:
                body.valid = False
        return ParseStep()
