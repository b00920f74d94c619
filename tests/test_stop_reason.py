"""``stop_reason`` as vLLM reports it: None when the model's EOS token ended a sample, the
token id when one of the request's ``stop_token_ids`` did, the string for a stop string."""

from __future__ import annotations

import json
import shutil

import pytest

from pyengine import LLM, SamplingParams
from pyengine.testing.checkpoints import make_tiny_checkpoint

LIMITS = dict(num_kv_blocks=32, max_num_seqs=2, max_num_batched_tokens=64)
PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny model, and a copy whose EOS is the token it greedily generates first."""
    base = make_tiny_checkpoint(tmp_path_factory.mktemp("stop") / "qwen3", "qwen3", seed=13)
    llm = LLM(str(base), **LIMITS)
    try:
        first = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids[0]
        eos = list(llm.engine_core.eos_token_ids)
    finally:
        llm.shutdown()
    assert first not in eos
    eos_copy = tmp_path_factory.mktemp("stop") / "eos-first"
    shutil.copytree(base, eos_copy)
    generation = json.loads((eos_copy / "generation_config.json").read_text())
    generation["eos_token_id"] = [first]
    (eos_copy / "generation_config.json").write_text(json.dumps(generation))
    return base, eos_copy, first


def test_eos_ends_with_stop_and_no_stop_reason(checkpoints):
    _, eos_first, first = checkpoints
    with LLM(str(eos_first), **LIMITS) as llm:
        c = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].outputs[0]
        # ...and a stop token id that is also EOS is reported, since the request named it.
        named = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[first]),
                             use_tqdm=False)[0].outputs[0]
    assert (c.token_ids, c.finish_reason, c.stop_reason) == ([first], "stop", None)
    assert (named.finish_reason, named.stop_reason) == ("stop", first)


def test_a_stop_token_id_is_the_stop_reason(checkpoints):
    base, _, first = checkpoints
    with LLM(str(base), **LIMITS) as llm:
        c = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[first]),
                         use_tqdm=False)[0].outputs[0]
        length = llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
    assert (c.token_ids, c.finish_reason, c.stop_reason) == ([first], "stop", first)
    assert (length.finish_reason, length.stop_reason) == ("length", None)
