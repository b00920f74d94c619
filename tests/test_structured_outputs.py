"""Structured outputs end to end on a random-weight tiny model: every constraint kind,
bad constraints refused before queueing, the compile cache, finish reasons, depth 1 ==
depth 2, and greedy choice decoding against transformers with an independent allowed-set."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import jsonschema
import pytest
import torch

from pyengine import LLM, AsyncEngine, InvalidRequestError, SamplingParams, StructuredOutputsParams
from pyengine.testing.checkpoints import make_tiny_checkpoint

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
PROMPTS = ["The quick brown fox", "Hello, world!", "def generate(prompt):", "Numbers: 0 1 2"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("structured") / "qwen3", "qwen3", seed=5)


@pytest.fixture(scope="module")
def llm(checkpoint):
    engine = LLM(str(checkpoint), max_num_seqs=32)
    yield engine
    engine.shutdown()


def run(llm, so, n=1, max_tokens=64, prompts=PROMPTS, **params):
    sp = SamplingParams(n=n, temperature=1.0, seed=7, max_tokens=max_tokens, structured_outputs=so, **params)
    return [c for o in llm.generate(prompts, sp, use_tqdm=False) for c in o.outputs]


def test_json_schema_outputs_validate(llm):
    outs = run(llm, StructuredOutputsParams(json=PERSON, disable_any_whitespace=True), n=2)
    stopped = [c for c in outs if c.finish_reason == "stop"]
    assert len(stopped) >= len(outs) // 2, [c.text for c in outs]
    for c in stopped:
        jsonschema.validate(json.loads(c.text), PERSON)
    assert all(c.finish_reason in ("stop", "length") for c in outs)


def test_json_object_regex_choice_and_grammar(llm):
    for c in run(llm, StructuredOutputsParams(json_object=True, disable_any_whitespace=True), max_tokens=24):
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:
            assert c.text.startswith("{")
    for c in run(llm, StructuredOutputsParams(regex=r"[a-z]{2,8}-[0-9]{1,3}")):
        assert c.finish_reason == "stop" and re.fullmatch(r"[a-z]{2,8}-[0-9]{1,3}", c.text), c.text
    choices = ["yes", "no", "maybe so", "{x}|[y]"]
    for c in run(llm, StructuredOutputsParams(choice=choices), n=3):
        assert c.finish_reason == "stop" and c.text in choices
    lark = 'start: "(" num ("+" num)? ")"\nnum: /[0-9]{1,3}/'
    for c in run(llm, StructuredOutputsParams(grammar=lark)):
        assert c.finish_reason == "stop" and re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})?\)", c.text), c.text


def test_max_tokens_before_the_grammar_completes_is_length(llm):
    outs = run(llm, StructuredOutputsParams(regex="[a-z]{20}"), max_tokens=3)
    assert all(c.finish_reason == "length" and re.fullmatch("[a-z]*", c.text) for c in outs)


def test_unconstrained_requests_in_the_same_batch_are_untouched(llm):
    free = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS, free, use_tqdm=False)
    constrained = SamplingParams(temperature=1.0, seed=3, max_tokens=12,
                                 structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    mixed = llm.generate(PROMPTS * 2, [free] * 4 + [constrained] * 4, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids for o in alone]
    assert all(o.outputs[0].text in ("yes", "no") for o in mixed[4:])


@pytest.mark.parametrize(
    "so, message",
    [
        (StructuredOutputsParams(regex="(ab"), "structured_outputs.regex is invalid"),
        (StructuredOutputsParams(json={"type": "strin"}), "structured_outputs.json is invalid"),
        (StructuredOutputsParams(json={"type": "string", "minLength": 5, "maxLength": 2}), "structured_outputs.json is invalid"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar is invalid"),
        (StructuredOutputsParams(regex="a", whitespace_pattern="("), None),
    ],
)
def test_invalid_constraints_are_refused_before_queueing(llm, so, message):
    if message is None:  # whitespace_pattern only matters to JSON: the regex compiles
        assert run(llm, so, prompts=PROMPTS[:1])[0].text == "a"
        return
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=so), use_tqdm=False)
    assert llm.engine_core.num_unfinished() == 0
    assert llm.engine_core.is_alive


def test_min_tokens_is_refused_with_a_constraint(llm):
    params = SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(choice=["a"]))
    with pytest.raises(InvalidRequestError, match="min_tokens cannot be combined with structured_outputs"):
        llm.generate(PROMPTS[:1], params, use_tqdm=False)


def test_schema_references_resolve_locally(llm):
    schema = {"$defs": {"flag": {"type": "boolean"}}, "type": "object",
              "properties": {"f": {"$ref": "#/$defs/flag"}}, "required": ["f"], "additionalProperties": False}
    for c in run(llm, StructuredOutputsParams(json=schema, disable_any_whitespace=True), prompts=PROMPTS[:2]):
        assert c.finish_reason == "stop" and json.loads(c.text)["f"] in (True, False)
    remote = {"type": "object", "properties": {"x": {"$ref": "https://example.com/schema.json"}}}
    with pytest.raises(InvalidRequestError, match="structured_outputs.json is invalid"):
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=StructuredOutputsParams(json=remote)),
                     use_tqdm=False)


def test_the_same_constraint_compiles_once(llm):
    compiler = llm.engine_core.constraints.native
    schema = {"type": "object", "properties": {"k": {"enum": [1, 2, 3]}}, "required": ["k"]}
    before = compiler.stats()
    run(llm, StructuredOutputsParams(json=schema), prompts=PROMPTS[:2])
    run(llm, StructuredOutputsParams(json=dict(schema)), prompts=PROMPTS[:2])
    after = compiler.stats()
    assert after["compiled"] == before["compiled"] + 1
    assert after["cache_hits"] >= before["cache_hits"] + 3
    first = llm.engine_core.constraints.compile(StructuredOutputsParams(json=schema))
    assert first.cached and first.kind == "json"


def test_pipeline_depth_one_and_two_give_the_same_tokens(checkpoint):
    so = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    params = [SamplingParams(n=2, temperature=1.0, seed=s, max_tokens=48, structured_outputs=so) for s in range(6)]
    prompts = [PROMPTS[i % 4] for i in range(6)]
    results = []
    for depth in (1, 2):
        with LLM(str(checkpoint), pipeline_depth=depth, max_num_seqs=16) as engine:
            outs = engine.generate(prompts, params, use_tqdm=False)
            results.append([(c.token_ids, c.finish_reason) for o in outs for c in o.outputs])
            assert engine.stats().scheduler["masks_computed"] > 0
    assert results[0] == results[1]


def test_async_engine_compiles_off_the_event_loop(checkpoint):
    engine = AsyncEngine(str(checkpoint), max_num_seqs=8)
    threads = []
    original = engine.engine_core.compile_structured_outputs

    def recording(params):
        threads.append(threading.current_thread())
        return original(params)

    engine.engine_core.compile_structured_outputs = recording

    async def main():
        loop_thread = threading.current_thread()
        outs = [o async for o in engine.generate(
            "hi", SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["a", "b"])))]
        with pytest.raises(InvalidRequestError, match="structured_outputs.regex is invalid"):
            async for _ in engine.generate("hi", SamplingParams(structured_outputs=StructuredOutputsParams(regex="("))):
                pass
        return loop_thread, outs[-1]

    try:
        loop_thread, last = asyncio.run(main())
    finally:
        engine.shutdown()
    assert last.outputs[0].text in ("a", "b")
    assert len(threads) == 2 and all(t is not loop_thread for t in threads)


def test_greedy_choice_matches_transformers_with_a_brute_force_allowed_set(checkpoint, llm):
    """The reference: transformers' logits, and the allowed tokens found by trying every
    token's bytes against the choices (nothing of llguidance's)."""
    import transformers

    choices = ["The quick brown fox", "The lazy dog", "Hello, world!", "scheduler plans"]
    table = llm.engine_core.decode_table
    eos = set(llm.engine_core.eos_token_ids)
    special = {i for i, (a, b) in enumerate(zip(table.token_bytes, table.token_bytes_skipping_special)) if a and not b}
    targets = [c.encode() for c in choices]
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        ids = llm.engine_core.tokenize(prompt)
        out, text = [], b""
        while True:
            if any(t == text for t in targets) and not any(t.startswith(text) and t != text for t in targets):
                break  # complete, nothing may follow: the grammar ends the output itself
            with torch.inference_mode():
                logits = model(torch.tensor([ids + out])).logits[0, -1]
            allowed = [
                i for i, b in enumerate(table.token_bytes)
                if b and i not in special and any(t.startswith(text + b) for t in targets)
            ]
            if any(t == text for t in targets):
                allowed += sorted(eos)
            best = max(allowed, key=lambda i: float(logits[i]))
            out.append(best)
            if best in eos:
                break
            text += table.token_bytes[best]
        got = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=40,
                                                 structured_outputs=StructuredOutputsParams(choice=choices)),
                           use_tqdm=False)[0].outputs[0]
        assert got.token_ids == out, (prompt, got.text, text)
        assert got.finish_reason == "stop"
