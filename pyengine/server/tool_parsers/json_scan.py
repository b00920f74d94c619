"""Incremental reading of one tool call's JSON as the model writes it.

``JsonValueScanner`` finds where a JSON value ends without parsing it (strings, escapes
and nesting tracked character by character), so that a value's text can be passed on
while it is still being generated. ``CallBody`` reads ``{"name": ..., "arguments": ...}``
(or Llama's ``"parameters"``): as soon as the name is known it is reported, and the
arguments' text follows chunk by chunk, exactly as written; when the call is closed the
whole body is checked with ``json.loads``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

# The start of a call in the usual key order, up to where the arguments' value begins.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_ARGUMENT_KEYS = ("arguments", "parameters")


class JsonValueScanner:
    """Finds the end of one JSON value fed in pieces (leading whitespace skipped)."""

    def __init__(self) -> None:
        self.depth = 0
        self.started = False
        self.done = False
        self._in_string = False
        self._escape = False
        self._scalar = False

    def feed(self, text: str) -> tuple[str, int]:
        """(the part of ``text`` that belongs to the value, how many characters of
        ``text`` were consumed). Once ``done``, nothing more is consumed."""
        start = None
        for i, ch in enumerate(text):
            if self.done:
                return (text[start:i] if start is not None else ""), i
            if not self.started:
                if ch.isspace():
                    continue
                self.started, start = True, i
                if ch in "{[":
                    self.depth = 1
                elif ch == '"':
                    self._in_string = True
                else:
                    self._scalar = True
                continue
            if start is None:
                start = i
            if self._scalar:
                if ch in ",}]" or ch.isspace():
                    self.done = True
                    return text[start:i], i
            elif self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                    self.done = self.depth == 0
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                self.done = self.depth == 0
        return (text[start:] if start is not None else ""), len(text)

    def end(self) -> None:
        """The text has ended: a bare scalar (``42``, ``true``) ends with it."""
        if self._scalar:
            self.done = True


@dataclass
class CallEvents:
    """What a piece of a call's body revealed: the name (once) and arguments text."""

    name: Optional[str] = None
    arguments: str = ""


class CallBody:
    """One tool call's JSON body, fed in pieces, closed by the caller (a closing tag, or
    the end of the object)."""

    def __init__(self) -> None:
        self.text = ""
        self.name: Optional[str] = None
        self.arguments = ""  # the arguments' JSON text as far as it has been reported
        self.valid = False  # set by close(): the body is a call whose arguments were reported whole
        self._args: Optional[JsonValueScanner] = None

    def feed(self, piece: str) -> CallEvents:
        self.text += piece
        events = CallEvents()
        if self._args is None:
            match = _HEADER.match(self.text)
            if match is None:
                return events
            self.name = events.name = json.loads(match.group(1))
            self._args = JsonValueScanner()
            piece = self.text[match.end():]
        if not self._args.done:
            value, _ = self._args.feed(piece)
            self.arguments += value
            events.arguments = value
        return events

    def close(self) -> CallEvents:
        """Checks the whole body. A call whose keys came in another order (so nothing was
        reported yet) is reported now, whole."""
        events = CallEvents()
        call = _load_call(self.text)
        if call is None:
            return events
        name, arguments = call
        if self._args is None:
            self.name = events.name = name
            self.arguments = events.arguments = json.dumps(arguments, ensure_ascii=False)
            self.valid = True
            return events
        self._args.end()
        self.valid = self._args.done and name == self.name and _same_json(self.arguments, arguments)
        return events


def _load_call(text: str) -> Optional[tuple[str, Any]]:
    """(name, arguments) of a call body, or None when it is not one."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    for key in _ARGUMENT_KEYS:
        if key in call:
            return call["name"], call[key]
    return call["name"], {}


def _same_json(text: str, value: Any) -> bool:
    try:
        return json.loads(text) == value
    except ValueError:
        return False
