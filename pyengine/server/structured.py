"""The output constraint a request asks for, whichever of its spellings it uses.

A client constrains a generation with OpenAI's ``response_format`` (``json_object``,
``json_schema``), vLLM's ``structured_outputs`` extra-body object, or vLLM's older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` fields.
``requested_constraint`` finds the one a request gives (two at once is a 400: which one
should win is not the server's guess) and names the field it came from, so that every
refusal names what the client sent.

Until the engine honours constraints, ``refuse_constraints`` answers every one with a 400
naming its field: a constraint silently dropped would hand a client free text it takes
for validated output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pyengine.server.errors import bad_request
from pyengine.server.protocol import SamplingFields

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


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


def refuse_constraints(body: SamplingFields) -> None:
    """A 400 naming the constraint field ``body`` uses: this server does not constrain
    generation yet, and answering free text would pass for a constrained answer."""
    constraint = requested_constraint(body)
    if constraint is not None:
        raise bad_request(f"{constraint.param} is not supported by this server yet: it cannot constrain "
                          "generation, and ignoring the constraint would return unconstrained text",
                          constraint.param, "unsupported_parameter")


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
