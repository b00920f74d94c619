"""What every tool-call parser shares: the events it emits and the whole-text parse.

A parser reads one choice's generated text, in the pieces it is streamed in, and splits
it into content (text outside tool calls) and tool calls (a name, then the arguments'
JSON text in chunks). The same code serves a whole response: ``parse_whole`` feeds the
text at once, so a streamed answer and a whole one cannot disagree.

Whitespace alone between or around tool calls (the newlines the formats put there) is no
content; a stretch that holds any other text is content as written.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from pyengine.server.tool_parsers.json_scan import CallBody


@dataclass(frozen=True)
class ToolCallChunk:
    """A piece of tool call ``index``: its ``name`` on the first piece, then arguments."""

    index: int
    name: Optional[str] = None
    arguments: str = ""


@dataclass
class ParseStep:
    """What one piece of text added: content and tool-call pieces."""

    content: str = ""
    calls: list[ToolCallChunk] = field(default_factory=list)

    def __iadd__(self, other: ParseStep) -> ParseStep:
        self.content += other.content
        self.calls.extend(other.calls)
        return self


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ParsedMessage:
    """A whole answer: ``content`` (None when there is none) and its tool calls."""

    content: Optional[str]
    calls: list[ParsedCall]


class OutsideText:
    """Content between tool calls: a stretch of whitespace only is held back, and dropped
    if a tool call follows it or ends the text."""

    def __init__(self) -> None:
        self._held = ""
        self._has_text = False

    def add(self, text: str) -> str:
        """What of ``text`` can be emitted as content now."""
        if self._has_text:
            return text
        self._held += text
        if self._held.strip():
            self._has_text = True
            out, self._held = self._held, ""
            return out
        return ""

    def end(self, keep_whitespace: bool) -> str:
        """The stretch ended (at a tool call, or at the end of the text)."""
        out = self._held if keep_whitespace else ""
        self._held, self._has_text = "", False
        return out


class ToolCallStream(ABC):
    """Incremental parser of one choice's text. ``max_calls`` (1 when the client asked
    ``parallel_tool_calls=false``) drops calls beyond it."""

    #: Whether the format's markers may be special tokens that the text must keep.
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, max_calls: Optional[int] = None) -> None:
        self.max_calls = max_calls
        self.bodies: list[CallBody] = []
        self.outside = OutsideText()

    @classmethod
    @abstractmethod
    def forced_grammar(cls, functions: Sequence[dict[str, Any]], many: bool) -> str:
        """A Lark grammar (llguidance's dialect) whose every sentence is one call
        (``many``: one or more) of ``functions`` in this format (``forced.py``)."""

    @abstractmethod
    def feed(self, text: str) -> ParseStep:
        """Content and tool-call pieces that ``text`` completes."""

    @abstractmethod
    def finish(self) -> ParseStep:
        """The end of the text: whatever was held back."""

    @property
    def calls(self) -> list[CallBody]:
        """The calls reported (a name was found), at most ``max_calls``."""
        return [b for b in self.bodies if b.name is not None][:self.max_calls]

    @property
    def valid(self) -> bool:
        """Every call opened is complete and well-formed JSON."""
        return all(b.valid for b in self.bodies)

    @property
    def has_valid_calls(self) -> bool:
        """Whether the answer (once finished) is tool calls: some were reported and all are
        well-formed. The one rule of a whole response's ``tool_calls`` and of both
        responses' ``finish_reason``."""
        return bool(self.calls) and self.valid

    # ---- for subclasses ----

    def _open_call(self) -> CallBody:
        body = CallBody()
        self.bodies.append(body)
        return body

    def _report(self, body: CallBody, events_name: Optional[str], arguments: str) -> list[ToolCallChunk]:
        """The pieces of ``body`` to emit (none past ``max_calls``)."""
        index = self.calls.index(body) if body in self.calls else None
        if index is None or (events_name is None and not arguments):
            return []
        return [ToolCallChunk(index, events_name, arguments)]


def parse_whole(stream: ToolCallStream, text: str) -> ParsedMessage:
    """The whole answer ``text`` parsed. When a tool call is cut short or malformed, the
    answer is the text itself with no tool calls (nothing half-parsed is passed on)."""
    step = stream.feed(text)
    step += stream.finish()
    if not stream.has_valid_calls:
        return ParsedMessage(text, [])
    return ParsedMessage(step.content or None, [ParsedCall(b.name or "", b.arguments) for b in stream.calls])
