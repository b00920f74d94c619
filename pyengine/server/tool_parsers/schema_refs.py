"""A tool's ``parameters`` schema placed inside a larger schema, its ``$ref``s still
pointing where they pointed.

A forced tool call is constrained by one schema that holds every tool's ``parameters``
somewhere below its root (``#/items/anyOf/0/properties/parameters``). A reference inside
those parameters is written against *their* root: ``"$ref": "#"`` (a recursive tree),
``"#/$defs/Node"``, ``"#/definitions/Node"``, ``"#/properties/child"``. The grammar backend
(llguidance, built without its ``referencing`` feature) resolves a ``$ref`` as a JSON
pointer from the root of the schema it compiles, so embedded unchanged they would point
into the wrapper and fail to compile or mean something else. ``embedded`` rewrites every
local reference to start at the place the parameters are put; definitions stay where
they are (no hoisting, so two tools may each define a ``Node`` of their own).

References that are not local (``other.json#/x``) and plain-name anchors (``"#Node"``,
a ``$anchor``, not a JSON pointer) are left as written: a pointer prefix would make the
anchor a wrong name, and the backend treats them as it does in a schema given alone.
"""

from __future__ import annotations

from typing import Any

# Keywords whose values are data, not schemas: a "$ref" key inside them is no reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example"})


def embedded(schema: Any, pointer: str) -> Any:
    """A copy of ``schema`` whose local ``$ref``s resolve from a wrapper that holds it at
    the JSON pointer ``pointer`` (``"/items/properties/parameters"``; ``""``: the root,
    a plain copy)."""
    if isinstance(schema, dict):
        out = {}
        for key, value in schema.items():
            if key == "$ref" and isinstance(value, str):
                out[key] = _moved(value, pointer)
            elif key in _DATA_KEYWORDS or key == "x-guidance":
                out[key] = value
            elif key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
                # Maps of names to schemas: a property named "const" or "$ref" is a name.
                out[key] = {name: embedded(sub, pointer) for name, sub in value.items()} \
                    if isinstance(value, dict) else value
            else:
                out[key] = embedded(value, pointer)
        return out
    if isinstance(schema, list):
        return [embedded(item, pointer) for item in schema]
    return schema


def _moved(reference: str, pointer: str) -> str:
    if not pointer or not (reference == "#" or reference.startswith("#/")):
        return reference  # another document, or a plain-name anchor ("#Node"): not a pointer
    rest = reference[1:]
    return "#" + pointer + ("" if rest == "/" else rest)  # "#/" is the root too, to llguidance
