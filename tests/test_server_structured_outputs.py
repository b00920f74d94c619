"""Constrained generation through the server, spoken with the official openai client
(issue 14): ``response_format`` (``json_object``, ``json_schema`` with ``strict``), vLLM's
``structured_outputs`` extra body and its ``guided_*`` fields, whole and streamed, on a
random-weight tiny checkpoint. Outputs are checked with ``jsonschema`` and ``re``, tools
nobody here wrote. Schemas are bounded (short strings, small numbers) so that a random
model finishes; ``x-guidance`` turns off free whitespace where a test needs outputs that
end (llguidance's own option, which jsonschema ignores)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from pyengine import AsyncEngine
from pyengine.server import ServerArgs
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.live_server import LiveServer

COMPACT = {"whitespace_flexible": False}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
    "x-guidance": COMPACT,
}
USER = [{"role": "user", "content": "Describe someone."}]
REGEX = r"[0-9]{3}-[a-z]{2}"
GRAMMAR = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'
GRAMMAR_AS_REGEX = r"\([0-9]{1,3}(\+[0-9]{1,3})*\)"
CHOICES = ["yes", "no", "maybe later"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))
    engine = AsyncEngine(path, max_num_seqs=16, max_model_len=512)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(engine):
    with LiveServer(engine, ServerArgs(model_name="m", stats_interval=0, log_requests=False)) as server:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=60, max_retries=0) as c:
            yield c


def chat(client, n=4, **kwargs):
    kwargs = {"max_tokens": 120, "temperature": 1.0, "seed": 7, **kwargs}
    return client.chat.completions.create(model="m", messages=USER, n=n, **kwargs)


def streamed_chat(client, n=2, **kwargs) -> dict[int, tuple[str, str]]:
    """{choice index: (content, finish_reason)} of a streamed chat."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in chat(client, n=n, stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return {i: (texts[i], reasons[i]) for i in texts}


def test_response_format_json_schema(client):
    out = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert len(out.choices) == 4
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_strict_closes_objects_that_say_nothing(client):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "x-guidance": COMPACT}
    closed = {**schema, "additionalProperties": False}
    out = chat(client, response_format={"type": "json_schema",
                                        "json_schema": {"name": "a", "schema": schema, "strict": True}})
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), closed)


def test_response_format_json_object(client):
    out = chat(client, response_format={"type": "json_object"}, max_tokens=40)
    for choice in out.choices:
        text = choice.message.content
        assert choice.finish_reason in ("stop", "length")
        assert text.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("extra", [
    {"structured_outputs": {"json": PERSON}},
    {"structured_outputs": {"json": {k: v for k, v in PERSON.items() if k != "x-guidance"},
                            "disable_any_whitespace": True}},
    {"guided_json": json.dumps(PERSON)},
])
def test_json_in_vllms_spellings(client, extra):
    for choice in chat(client, extra_body=extra).choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
    ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
    ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
    ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
    ({"structured_outputs": {"grammar": GRAMMAR}}, lambda t: re.fullmatch(GRAMMAR_AS_REGEX, t)),
    ({"guided_grammar": GRAMMAR}, lambda t: re.fullmatch(GRAMMAR_AS_REGEX, t)),
])
def test_regex_choice_and_grammar_on_both_endpoints(client, extra, check):
    for choice in chat(client, extra_body=extra).choices:
        assert choice.finish_reason == "stop" and check(choice.message.content), choice.message.content
    out = client.completions.create(model="m", prompt=["Once", "upon a time"], max_tokens=60, n=2, seed=3,
                                    temperature=1.0, extra_body=extra)
    assert len(out.choices) == 4
    for choice in out.choices:
        assert choice.finish_reason == "stop" and check(choice.text), choice.text


def test_streamed_constrained_outputs(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for text, reason in streamed_chat(client, response_format=fmt).values():
        assert reason == "stop"
        jsonschema.validate(json.loads(text), PERSON)
    pieces, reasons = {}, {}
    for chunk in client.completions.create(model="m", prompt="x", max_tokens=60, n=3, seed=5, temperature=1.0,
                                           stream=True, extra_body={"guided_regex": REGEX}):
        for choice in chunk.choices:
            pieces[choice.index] = pieces.get(choice.index, "") + choice.text
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    assert len(pieces) == 3
    assert all(re.fullmatch(REGEX, t) for t in pieces.values()) and set(reasons.values()) == {"stop"}


def test_a_constrained_request_cut_by_max_tokens_is_length(client):
    long_choice = ["abcdefghijklmnopqrstuvwxyz" * 2]
    out = chat(client, max_tokens=3, extra_body={"guided_choice": long_choice})
    for choice in out.choices:
        assert choice.finish_reason == "length"
        assert long_choice[0].startswith(choice.message.content) and choice.message.content
    assert out.usage.completion_tokens == 3 * len(out.choices)
    for text, reason in streamed_chat(client, max_tokens=3, extra_body={"guided_choice": long_choice}).values():
        assert reason == "length" and long_choice[0].startswith(text)


@pytest.mark.parametrize("extra, param, what", [
    ({"structured_outputs": {"json": {"type": 5}}}, "structured_outputs.json", "type must be a string"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "http://example.com/x"}}}}, "guided_json",
     "$ref"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "unclosed group"),
    ({"guided_regex": "[z-a]"}, "guided_regex", "invalid regex"),
    ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs.grammar", "unknown name"),
    ({"guided_grammar": "start: ("}, "guided_grammar", "Expected token ')'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nothing"}}}},
     "response_format", "Invalid type: nothing"),
])
def test_invalid_constraints_are_400s_naming_the_field(client, engine, extra, param, what):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, n=1, stream=stream, extra_body=extra)
        assert info.value.param == param, info.value.body
        message = info.value.body["message"]
        assert what in message and message.startswith(param), message
    if "response_format" not in extra:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="m", prompt="x", max_tokens=5, extra_body=extra)
        assert info.value.param == param
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0  # nothing was queued


def test_constrained_and_free_requests_share_the_engine(client):
    """A batch mixing constrained and free requests: each gets what it asked for."""
    import concurrent.futures

    def constrained(i):
        return chat(client, n=2, extra_body={"guided_regex": REGEX}, seed=i)

    def free(i):
        return chat(client, n=2, seed=i, max_tokens=20, extra_body={"ignore_eos": True})

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda f_i: f_i[0](f_i[1]), [(constrained, i) for i in range(4)] +
                                [(free, i) for i in range(4)]))
    for out in results[:4]:
        assert all(re.fullmatch(REGEX, c.message.content) for c in out.choices)
    for out in results[4:]:
        assert all(c.finish_reason == "length" for c in out.choices) and out.usage.completion_tokens == 40
