"""Synthetic executors apply grammar masks: an engine on ``SleepRunner`` with an EOS id
serves constrained requests by their grammar (no dead end on the first refused token),
and unconstrained requests sample exactly what they sample without a constraint nearby."""

from __future__ import annotations

import json
import re

import numpy as np

from pyengine import LLM, SamplingParams, StructuredOutputsParams
from pyengine.config import EngineConfig
from pyengine.devtools.fake_executor import allowed_pick
from pyengine.engine.core import EngineCore
from pyengine.testing.synthetic_runner import SleepRunner

REGEX = r"[0-9]{2,6}-[a-z]{1,4}"
PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]


def synthetic_llm() -> LLM:
    runner = SleepRunner(0.0, eos_token_ids=(0,))
    return LLM.from_engine_core(EngineCore(EngineConfig(max_num_seqs=8), runner=runner))


def test_allowed_pick_takes_only_allowed_tokens():
    vocab = 70
    bits = np.zeros((3, 3), dtype=np.uint32)
    bits[0, 1] = 1 << 4  # token 36 only
    bits[1, 0], bits[1, 2] = 0b101, 1 << 5  # tokens 0, 2 and 69
    # row 2: nothing allowed -> the fallback
    seqs, positions = np.array([1, 2, 3]), np.array([10, 11, 12])
    picked = allowed_pick(bits, vocab, seqs, positions, np.array([-7, -7, -7]))
    assert picked[0] == 36 and picked[1] in (0, 2, 69) and picked[2] == -7
    # The same (sequence, position) picks the same token; other positions spread over the set.
    many = allowed_pick(np.repeat(bits[1:2], 64, axis=0), vocab, np.arange(64), np.arange(64), np.zeros(64))
    assert set(many.tolist()) == {0, 2, 69}
    narrow = allowed_pick(bits[1:2], 60, seqs[:1], positions[:1], np.array([-7]))  # 69 is past the vocabulary
    assert narrow[0] in (0, 2)


def test_a_synthetic_engine_serves_constrained_requests():
    free = SamplingParams(max_tokens=12, ignore_eos=True)
    llm = synthetic_llm()  # tokens hash (sequence id, position): fresh engines for the same ids
    try:
        alone = llm.generate(PROMPTS, free, use_tqdm=False)
    finally:
        llm.shutdown()
    llm = synthetic_llm()
    try:
        regex = SamplingParams(max_tokens=24, n=4, structured_outputs=StructuredOutputsParams(regex=REGEX))
        choice = SamplingParams(max_tokens=24, n=2, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
        schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
                  "additionalProperties": False}
        json_params = SamplingParams(max_tokens=40, structured_outputs=StructuredOutputsParams(
            json=schema, disable_any_whitespace=True))
        outs = llm.generate(PROMPTS + [[1, 2]] * 3, [free, free, regex, choice, json_params], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs[:2]] == [o.outputs[0].token_ids for o in alone]
        completions = [c for o in outs[2:] for c in o.outputs]
        assert all(c.finish_reason in ("stop", "length") for c in completions), [c.finish_reason for c in completions]
        for c in outs[2].outputs:
            if c.finish_reason == "stop":
                assert re.fullmatch(REGEX, c.text), c.text
            else:
                assert re.fullmatch(r"[0-9]{0,6}(-[a-z]{0,4})?", c.text), c.text
        assert all(c.text in ("yes", "no") and c.finish_reason == "stop" for c in outs[3].outputs)
        if outs[4].outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(outs[4].outputs[0].text)["a"], bool)
        assert sum(c.finish_reason == "stop" for c in completions) >= 3
    finally:
        llm.shutdown()
