"""``StructuredOutputsParams``: what a request's output must match (vLLM's field names).

Exactly one constraint kind is set:

- ``json``: a JSON Schema (a dict, or its JSON text);
- ``json_object``: ``True`` for any JSON object;
- ``regex``: a regular expression the whole output matches (Rust ``regex`` syntax, as
  llguidance reads it; no look-around or back-references);
- ``choice``: the output is exactly one of these strings;
- ``grammar``: a context-free grammar in llguidance's Lark dialect
  (``start: item ("," item)*``, terminals as ``/regex/`` or ``"literal"``; see
  ``docs/structured_outputs.md``).

Options for JSON (``json`` and ``json_object``): ``disable_any_whitespace`` emits compact
JSON (no free whitespace between tokens), ``whitespace_pattern`` replaces the whitespace
allowed there by a regex, ``disable_additional_properties`` closes every object schema
that does not say otherwise (``additionalProperties: false``).

The constraint is compiled when the request is added (``InvalidRequestError`` naming
what is wrong for a bad schema, regex or grammar) and enforced by the scheduler thread
(``docs/structured_outputs.md``).
"""

from __future__ import annotations

import json as _json
from copy import copy
from dataclasses import dataclass
from typing import Optional, Union

from pyengine.errors import InvalidRequestError

__all__ = ["StructuredOutputsParams", "CONSTRAINT_KINDS"]

#: The constraint fields, one of which must be set.
CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")

#: Limits on what one request may ask to compile (far beyond what clients send).
MAX_CONSTRAINT_CHARS = 1_000_000
MAX_CHOICES = 4096


@dataclass(slots=True)
class StructuredOutputsParams:
    """A request's output constraint; see the module docstring."""

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        """The constraint kind set (one of ``CONSTRAINT_KINDS``)."""
        return self._set_kinds()[0]

    def _set_kinds(self) -> list[str]:
        return [name for name in CONSTRAINT_KINDS if _is_set(name, getattr(self, name))]

    def validate(self) -> None:
        """Raises ``InvalidRequestError`` naming the fields when not exactly one constraint
        is set, or a field of the wrong type. (Whether a schema, regex or grammar is valid
        is decided by compiling it, when the request is added.)"""
        kinds = self._set_kinds()
        if len(kinds) != 1:
            got = ", ".join(kinds) if kinds else "none"
            raise InvalidRequestError(
                f"structured_outputs needs exactly one of {', '.join(CONSTRAINT_KINDS)}; got {got}"
            )
        if self.json is not None:
            _require(isinstance(self.json, (str, dict)), "json", "must be a JSON Schema (a dict or its JSON text)")
            if isinstance(self.json, str):
                try:
                    parsed = _json.loads(self.json)
                except ValueError as e:
                    raise InvalidRequestError(f"structured_outputs.json is not valid JSON: {e}") from None
                _require(isinstance(parsed, (dict, bool)), "json", "must be a JSON Schema object")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                _require(isinstance(value, str) and value != "", name, "must be a non-empty string")
        if self.choice is not None:
            _require(isinstance(self.choice, (list, tuple)) and len(self.choice) > 0, "choice",
                     "must be a non-empty list of strings")
            _require(len(self.choice) <= MAX_CHOICES, "choice", f"may hold at most {MAX_CHOICES} strings")
            for item in self.choice:
                _require(isinstance(item, str), "choice", f"must hold strings, got {item!r}")
        if self.json_object is not None:
            _require(isinstance(self.json_object, bool), "json_object", "must be a boolean")
        if self.whitespace_pattern is not None:
            _require(isinstance(self.whitespace_pattern, str), "whitespace_pattern", "must be a string (a regex)")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            _require(isinstance(getattr(self, name), bool), name, "must be a boolean")
        _require(len(self.spec_text()) <= MAX_CONSTRAINT_CHARS, self.kind,
                 f"may be at most {MAX_CONSTRAINT_CHARS} characters long")

    def spec_text(self) -> str:
        """The constraint as text (the JSON Schema serialised, the choices as a JSON list):
        what the compiler reads, and part of its cache key."""
        kind = self.kind
        if kind == "json":
            return self.json if isinstance(self.json, str) else _json.dumps(self.json, ensure_ascii=False)
        if kind == "choice":
            return _json.dumps(list(self.choice or ()), ensure_ascii=False)
        if kind == "json_object":
            return ""
        return str(getattr(self, kind))

    def clone(self) -> StructuredOutputsParams:
        """A copy whose ``json`` dict and ``choice`` list are copies too."""
        out = copy(self)
        if isinstance(self.json, dict):
            out.json = _json.loads(_json.dumps(self.json))
        if self.choice is not None:
            out.choice = list(self.choice)
        return out


def _is_set(name: str, value: object) -> bool:
    if name == "json_object":
        return value is not None and value is not False
    return value is not None


def _require(ok: bool, name: str, requirement: str) -> None:
    if not ok:
        raise InvalidRequestError(f"structured_outputs.{name} {requirement}")
