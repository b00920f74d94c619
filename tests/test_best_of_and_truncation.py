"""``best_of`` (the n candidates of highest cumulative log-probability) and
``truncate_prompt_tokens`` (the prompt's last k tokens), as vLLM's SamplingParams have
them, through LLM.generate and AsyncEngine."""

from __future__ import annotations

import asyncio

import pytest

from pyengine import LLM, AsyncEngine, SamplingParams
from pyengine.errors import InvalidRequestError
from pyengine.testing.checkpoints import make_tiny_checkpoint

PROMPT = [11, 42, 7, 99, 3, 250, 18, 64, 5, 301]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("bestof") / "qwen3", "qwen3", seed=5)
    with LLM(str(path), max_num_seqs=8, max_model_len=128) as llm:
        yield llm


def test_best_of_returns_the_n_candidates_of_highest_cumulative_logprob(llm):
    base = dict(temperature=1.0, seed=21, max_tokens=8, ignore_eos=True)
    # The same seeded candidates, all returned: seeded samples do not depend on the batch.
    every = llm.generate([PROMPT], SamplingParams(n=5, logprobs=0, **base), use_tqdm=False)[0].outputs
    ranked = sorted(every, key=lambda c: -c.cumulative_logprob)
    assert len({tuple(c.token_ids) for c in every}) > 2, "the candidates should differ"
    best = llm.generate([PROMPT], SamplingParams(n=2, best_of=5, **base), use_tqdm=False)[0].outputs
    assert [c.index for c in best] == [0, 1]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked[:2]]
    assert [c.cumulative_logprob for c in best] == pytest.approx([c.cumulative_logprob for c in ranked[:2]])
    assert all(c.logprobs is None for c in best)  # ranked by log-probability, none asked for
    assert all(c.text for c in best)
    with_lps = llm.generate([PROMPT], SamplingParams(n=1, best_of=5, logprobs=1, **base), use_tqdm=False)[0]
    assert with_lps.outputs[0].token_ids == ranked[0].token_ids and len(with_lps.outputs[0].logprobs) == 8
    assert llm.stats().kv_usage == 0.0


def test_best_of_streams_only_its_final_output(llm):
    engine = AsyncEngine.from_engine_core(llm.engine_core)

    async def run(kind):
        params = SamplingParams(n=1, best_of=3, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
        return [o async for o in engine.generate(PROMPT, params, output_kind=kind)]

    for kind in ("cumulative", "delta"):
        outs = asyncio.run(run(kind))
        assert len(outs) == 1 and outs[0].finished and len(outs[0].outputs) == 1
        assert len(outs[0].outputs[0].token_ids) == 6


@pytest.mark.parametrize("params,match", [
    (dict(n=3, best_of=2), "best_of must be >= n"),
    (dict(best_of=2, temperature=0.0), "best_of must be 1 with greedy sampling"),
    (dict(best_of=0), "best_of must be >= n"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be >= 1, or -1"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens must be >= 1, or -1"),
])
def test_bad_values_are_refused_naming_the_field(params, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**params)


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    greedy = dict(temperature=0.0, max_tokens=5, ignore_eos=True)
    cut = llm.generate([PROMPT], SamplingParams(truncate_prompt_tokens=4, **greedy), use_tqdm=False)[0]
    direct = llm.generate([PROMPT[-4:]], SamplingParams(**greedy), use_tqdm=False)[0]
    assert cut.prompt_token_ids == PROMPT[-4:]
    assert cut.outputs[0].token_ids == direct.outputs[0].token_ids
    whole = llm.generate([PROMPT], SamplingParams(truncate_prompt_tokens=-1, **greedy), use_tqdm=False)[0]
    assert whole.prompt_token_ids == PROMPT  # -1: up to max_model_len (128)
    longer = llm.generate([PROMPT], SamplingParams(truncate_prompt_tokens=50, **greedy), use_tqdm=False)[0]
    assert longer.prompt_token_ids == PROMPT
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens = 129 exceeds max_model_len = 128"):
        llm.generate([PROMPT], SamplingParams(truncate_prompt_tokens=129), use_tqdm=False)
    # -1 keeps max_model_len tokens (vLLM's meaning): a longer prompt then leaves no room
    # for an output token, and is refused for that, not for its length as sent.
    with pytest.raises(InvalidRequestError, match=r"prompt \(128 tokens\) \+ max_tokens \(1\) = 129 exceeds"):
        llm.generate([list(range(3, 203))], SamplingParams(truncate_prompt_tokens=-1, max_tokens=1), use_tqdm=False)
    out = llm.generate([list(range(3, 203))], SamplingParams(truncate_prompt_tokens=100, max_tokens=2, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == list(range(103, 203)) and len(out.outputs[0].token_ids) == 2
