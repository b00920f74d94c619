"""Forced tool calls without a tool-call parser, as vLLM serves them: the constraint
that makes the model call, and the reading of its answer into calls.

``tool_choice="required"`` (or a named function) on a server started without
``--tool-call-parser`` cannot use the model's own call format (the server does not know
it), so generation is constrained to a format of the server's own, vLLM's:

- ``"required"``: a JSON array of ``{"name": <one of the tools>, "parameters": <that
  tool's parameters>}`` objects, at least one (exactly one when the client asked
  ``parallel_tool_calls=false``; vLLM does not bound it);
- a named function: that function's ``parameters`` object alone, the call's arguments.

``forced_tool_calls`` builds it from OpenAI function objects (``{"name", "parameters"}``,
whichever API they came in: chat's ``tools[i].function`` or the Responses API's flat
tools), and ``ForcedToolCalls`` gives the engine's constraint, a stream parser for
streamed answers and ``parse`` for whole ones. With a parser configured the chat handler
uses the parser's own format instead (``tool_parsers/forced.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from pyengine.errors import InvalidRequestError
from pyengine.server.tool_parsers import ParsedCall, ToolCallStream, parse_whole
from pyengine.server.tool_parsers.forced_json import JsonArrayToolCallStream, NamedArgumentsToolCallStream
from pyengine.structured_outputs import StructuredOutputsParams


@dataclass(frozen=True)
class ForcedToolCalls:
    """A forced ``tool_choice``'s constraint (``grammar``, llguidance's Lark dialect with
    the calls as one ``%json`` schema) and how its answers read."""

    grammar: str
    name: Optional[str]  # the function the client named; None for "required"
    many: bool  # more than one call allowed

    @property
    def named(self) -> bool:
        return self.name is not None

    def structured_outputs(self) -> StructuredOutputsParams:
        """The engine's constraint (a tool whose ``parameters`` do not compile fails when
        the request is added, as any constraint does)."""
        return StructuredOutputsParams(grammar=self.grammar)

    def stream(self) -> ToolCallStream:
        """A parser for one choice's answer, fed as it streams."""
        if self.name is not None:
            return NamedArgumentsToolCallStream(self.name)
        return JsonArrayToolCallStream(None if self.many else 1)

    def parse(self, text: str) -> Optional[list[ParsedCall]]:
        """The calls of a whole answer, or None when it is not whole calls (cut by
        ``max_tokens``, say: nothing half-parsed is passed on)."""
        calls = parse_whole(self.stream(), text).calls
        return calls or None


def forced_tool_calls(functions: Sequence[Mapping[str, Any]], name: Optional[str] = None,
                      parallel: bool = True) -> ForcedToolCalls:
    """The forced calls of ``functions`` (OpenAI function objects): one or more of any
    (``name`` None: ``tool_choice="required"``; one with ``parallel=False``), or one of
    the function called ``name``. ``InvalidRequestError`` when there is no function, or
    none called ``name`` (the caller names its own field in the 400)."""
    functions = [dict(f) for f in functions]
    if not functions:
        raise InvalidRequestError("a forced tool call needs at least one tool")
    if name is None:
        return ForcedToolCalls(JsonArrayToolCallStream.forced_grammar(functions, parallel), None, parallel)
    chosen = [f for f in functions if f.get("name") == name][:1]
    if not chosen:
        names = ", ".join(str(f.get("name")) for f in functions)
        raise InvalidRequestError(f"the function {name!r} is not among the tools ({names})")
    return ForcedToolCalls(NamedArgumentsToolCallStream.forced_grammar(chosen, False), name, False)
