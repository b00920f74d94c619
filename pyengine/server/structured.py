"""The output constraint a request asks for, whichever of its spellings it uses, as the
engine's ``StructuredOutputsParams``.

A client constrains a generation with OpenAI's ``response_format`` (``json_object``,
``json_schema``), vLLM's ``structured_outputs`` extra-body object, or vLLM's older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` fields (with
``guided_whitespace_pattern``; ``guided_decoding_backend`` names a backend and changes
nothing: there is one, llguidance). ``requested_constraint`` finds the one a request
gives (two at once is a 400: which one should win is not the server's guess) and names
the field it came from, so that every refusal names what the client sent: a malformed
constraint here, a schema, regex or grammar the engine cannot compile when the request
is added (``name_constraint_error``), both before anything is queued.

``json_schema`` with ``strict: true`` closes every object schema that does not say
otherwise (``disable_additional_properties``), as OpenAI's strict mode reads a schema.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from pyengine.errors import InvalidRequestError
from pyengine.server.errors import APIError, bad_request
from pyengine.server.protocol import SamplingFields
from pyengine.structured_outputs import StructuredOutputsParams

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# How the engine names a constraint in its messages ("structured_outputs.json is not ...").
_ENGINE_NAME = re.compile(r"structured_outputs(\.[a-z_]+)?")


@dataclass(frozen=True)
class Constraint:
    """One requested constraint: ``kind`` is a ``StructuredOutputsParams`` field name
    (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``), ``value`` what it
    holds, ``param`` the request field it came from (for error messages)."""

    kind: str
    value: Any
    param: str


def requested_constraint(body: SamplingFields) -> Optional[Constraint]:
    """The constraint ``body`` asks for, or None (``response_format`` of type ``text``
    asks for none). A 400 names the field when the request is malformed or gives more
    than one constraint."""
    found = [c for c in (_from_response_format(body), *_from_structured_outputs(body), *_from_guided(body))
             if c is not None]
    if len(found) > 1:
        names = ", ".join(c.param for c in found)
        raise bad_request(f"a request may give one output constraint; this one gives {len(found)} ({names})",
                          found[1].param, "conflicting_constraints")
    return found[0] if found else None


def structured_outputs_params(body: SamplingFields) -> tuple[Optional[StructuredOutputsParams], Optional[str]]:
    """The engine's constraint for ``body`` and the request field it came from (for
    errors), or (None, None). A malformed constraint is a 400 naming its field."""
    constraint = requested_constraint(body)
    if constraint is None:
        return None, None
    if constraint.kind == "structural_tag":
        raise bad_request("structured_outputs.structural_tag is not supported; use json, regex, choice or grammar",
                          constraint.param, "unsupported_parameter")
    options: dict[str, Any] = {}
    so = body.structured_outputs
    if so is not None:
        options = {"disable_any_whitespace": so.disable_any_whitespace,
                   "disable_additional_properties": so.disable_additional_properties,
                   "whitespace_pattern": so.whitespace_pattern}
    elif constraint.param.startswith("guided_") and body.guided_whitespace_pattern is not None:
        options = {"whitespace_pattern": body.guided_whitespace_pattern}
    elif constraint.param == "response_format" and body.response_format is not None \
            and body.response_format.json_schema is not None and body.response_format.json_schema.strict:
        options = {"disable_additional_properties": True}
    try:
        return StructuredOutputsParams(**{constraint.kind: constraint.value}, **options), constraint.param
    except InvalidRequestError as error:
        raise name_constraint_error(bad_request(str(error)), constraint.param) from None


def name_constraint_error(error: APIError, param: Optional[str]) -> APIError:
    """``error``, raised while a constrained request was added, named by the field the
    client used (``param``) when the engine named none: its compiler says
    ``invalid regex: ...``, its checks ``structured_outputs.json ...``. Errors that
    already name a field (``max_tokens``), and all but 400s, pass unchanged."""
    if param is None or error.status != 400 or error.param is not None:
        return error
    message = error.message
    if _ENGINE_NAME.match(message):
        message = _ENGINE_NAME.sub(param, message, count=1) if not param.startswith("structured_outputs") \
            else message
    else:
        message = f"{param}: {message}"
    return bad_request(message, param, error.code)


def _from_response_format(body: SamplingFields) -> Optional[Constraint]:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint("json_object", True, "response_format")
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise bad_request("response_format of type 'json_schema' needs json_schema.schema (the JSON schema)",
                              "response_format.json_schema")
        return Constraint("json", fmt.json_schema.json_schema, "response_format")
    raise bad_request(f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}; got {fmt.type!r}",
                      "response_format.type", "invalid_value")


def _from_structured_outputs(body: SamplingFields) -> list[Optional[Constraint]]:
    so = body.structured_outputs
    if so is None:
        return []
    given = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
             "json_object": so.json_object or None, "structural_tag": so.structural_tag}
    found = [Constraint(kind, value, f"structured_outputs.{kind}") for kind, value in given.items()
             if value is not None]
    if not found:
        raise bad_request("structured_outputs gives no constraint: set one of json, regex, choice, grammar or "
                          "json_object", "structured_outputs")
    return list(found)


def _from_guided(body: SamplingFields) -> list[Optional[Constraint]]:
    return [Constraint(name.removeprefix("guided_"), getattr(body, name), name) for name in _GUIDED
            if getattr(body, name) is not None]
