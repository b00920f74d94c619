"""StructuredOutputsParams: vLLM's field names, exactly one constraint kind, typed errors."""

from __future__ import annotations

import pytest

import pyengine
from pyengine import InvalidRequestError, SamplingParams, StructuredOutputsParams
from pyengine.sampling_params import StructuredOutputsParams as FromSamplingParams


def test_exported_from_the_package_and_from_sampling_params():
    assert FromSamplingParams is StructuredOutputsParams is pyengine.StructuredOutputsParams


@pytest.mark.parametrize(
    "kwargs, kind",
    [
        (dict(json={"type": "object"}), "json"),
        (dict(json='{"type": "string"}'), "json"),
        (dict(regex="[a-z]+"), "regex"),
        (dict(choice=["yes", "no"]), "choice"),
        (dict(grammar='start: "a"+'), "grammar"),
        (dict(json_object=True), "json_object"),
    ],
)
def test_each_kind_alone_is_accepted(kwargs, kind):
    assert StructuredOutputsParams(**kwargs).kind == kind


def test_none_or_two_kinds_are_refused_naming_the_fields():
    with pytest.raises(InvalidRequestError, match="exactly one of .*got none"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(InvalidRequestError, match="got none"):
        StructuredOutputsParams(json_object=False)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(json="{not json"), "structured_outputs.json is not valid JSON"),
        (dict(json="[1, 2]"), "structured_outputs.json must be a JSON Schema object"),
        (dict(json=3), "structured_outputs.json must be a JSON Schema"),
        (dict(regex=""), "structured_outputs.regex must be a non-empty string"),
        (dict(choice=[]), "structured_outputs.choice must be a non-empty list"),
        (dict(choice=["a", 1]), "structured_outputs.choice must hold strings"),
        (dict(json_object=1), "structured_outputs.json_object must be a boolean"),
        (dict(regex="a", whitespace_pattern=3), "whitespace_pattern must be a string"),
    ],
)
def test_wrong_types_are_refused(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_carry_and_copy_it():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    so = StructuredOutputsParams(json=schema)
    params = SamplingParams(structured_outputs=so)
    copy = params.checked()
    assert copy.structured_outputs == so and copy.structured_outputs is not so
    schema["properties"]["b"] = {"type": "string"}  # the caller's dict changes later
    assert "b" not in copy.structured_outputs.json["properties"]


def test_sampling_params_refuse_other_types_and_later_bad_changes():
    with pytest.raises(InvalidRequestError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"))
    params.structured_outputs.choice = ["b"]  # now two kinds are set
    with pytest.raises(InvalidRequestError, match="got regex, choice"):
        params.checked()


def test_spec_text_is_the_compilers_input():
    assert StructuredOutputsParams(choice=["a", "é"]).spec_text() == '["a", "é"]'
    assert StructuredOutputsParams(json={"type": "string"}).spec_text() == '{"type": "string"}'
    assert StructuredOutputsParams(json_object=True).spec_text() == ""
