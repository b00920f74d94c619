"""Grammars that force tool calls (``tool_choice="required"`` or a named function) in a
parser's own format, in llguidance's Lark dialect with the calls embedded as JSON schemas
(``%json {...}``).

Why the model's own format and not vLLM's JSON array (vLLM constrains a forced call to
``[{"name": ..., "parameters": ...}]`` whatever the model): a model writes best the format
it was trained on, the answer then reads like its other calls (a history that holds it
renders as the template expects), and one parser reads forced and free calls alike. The
JSON of a call is one schema: ``anyOf`` over the tools, each an object whose ``name`` is
that tool's (``const``) and whose arguments follow that tool's ``parameters``; ``name``
is listed first, so that the call streams in the order the parser reports it. The JSON
is written as templates write it (``, `` and ``: ``, no other whitespace). A tool's
``$ref``s are rewritten to resolve inside the call's schema (``schema_refs.py``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pyengine.server.tool_parsers.schema_refs import embedded

# llguidance's JSON options: the separators of json.dumps / jinja's tojson (how templates
# write calls into prompts, so how models learned to write them), and no other whitespace
# (free whitespace lets a weak model pad a call until max_tokens).
AS_TEMPLATES_WRITE_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def call_schema(functions: Sequence[dict[str, Any]], arguments_key: str) -> dict[str, Any]:
    """The JSON schema of one call of any of ``functions`` (``{"name", "parameters"}``
    dicts, OpenAI's function objects)."""
    return {"x-guidance": AS_TEMPLATES_WRITE_JSON, **one_of_calls(functions, arguments_key, "")}


def one_of_calls(functions: Sequence[dict[str, Any]], arguments_key: str, pointer: str) -> dict[str, Any]:
    """The schema of one ``{"name": ..., arguments_key: ...}`` object calling any of
    ``functions``, to be placed at the JSON pointer ``pointer`` of the whole schema (each
    tool's ``$ref``s are rewritten to resolve from there)."""
    if len(functions) == 1:
        return _call_of(functions[0], arguments_key, f"{pointer}/properties/{arguments_key}")
    return {"anyOf": [_call_of(function, arguments_key, f"{pointer}/anyOf/{i}/properties/{arguments_key}")
                      for i, function in enumerate(functions)]}


def _call_of(function: dict[str, Any], arguments_key: str, pointer: str) -> dict[str, Any]:
    # No parameters: an empty object, as vLLM fills them in.
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, arguments_key: embedded(parameters, pointer)},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def lark_literal(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text)


def calls_grammar(call: str, separator: str, many: bool) -> str:
    """``start`` is one ``call`` rule, or one or more separated by ``separator``."""
    if many:
        return f"start: call ({lark_literal(separator)} call)*\n{call}"
    return f"start: call\n{call}"
