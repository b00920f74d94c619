"""Speculative decoding through the whole engine with the real model runner: greedy
outputs identical to speculation off, for each method the scheduler proposes, under
preemption (a small KV pool), prefix caching, n > 1, structured outputs and tensor
parallelism; a failed step with drafts in flight leaves the KV pool whole."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pyengine import LLM, SamplingParams
from pyengine.errors import EngineError
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.faults import install_faulty_runner

MAX_TOKENS = 24
METHODS = ("ngram", "suffix")


def spec(method: str) -> dict:
    config = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        config.update(prompt_lookup_min=1, prompt_lookup_max=3)
    return config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "qwen3", "qwen3", seed=3)


@pytest.fixture(scope="module")
def prompts():
    """Prompts with repeated spans (lookup finds matches) and random ones."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(24):
        span = rng.integers(3, 500, int(rng.integers(3, 9))).tolist()
        out.append(span * 4 if i % 2 == 0 else rng.integers(3, 500, int(rng.integers(4, 40))).tolist())
    return out


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def generate(checkpoint, prompts, params=GREEDY, **engine_args):
    with LLM(str(checkpoint), **engine_args) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    return [[list(c.token_ids) for c in o.outputs] for o in outs], stats


@pytest.fixture(scope="module")
def reference(checkpoint, prompts):
    return generate(checkpoint, prompts)[0]


def assert_same(got, reference):
    bad = [i for i, (a, b) in enumerate(zip(got, reference)) if a != b]
    assert not bad, f"{len(bad)} prompts differ, first {bad[0]}: {got[bad[0]]} vs {reference[bad[0]]}"


@pytest.mark.parametrize("method", METHODS)
def test_greedy_outputs_equal_speculation_off(checkpoint, prompts, reference, method):
    got, stats = generate(checkpoint, prompts, speculative_config=spec(method))
    assert_same(got, reference)
    assert stats.scheduler["spec_draft_tokens"] > 0
    assert stats.scheduler["spec_accepted_tokens"] > 0  # some drafts were right: verification kept them
    assert stats.kv_usage == 0.0


@pytest.mark.parametrize("method", METHODS)
def test_preemption_with_a_small_pool(checkpoint, prompts, reference, method):
    got, stats = generate(checkpoint, prompts, speculative_config=spec(method), num_kv_blocks=24,
                          max_num_seqs=8, block_size=16)
    assert_same(got, reference)
    assert stats.preemptions > 0
    assert stats.kv_usage == 0.0


def test_prefix_cache_hits_with_speculation(checkpoint, prompts, reference):
    with LLM(str(checkpoint), speculative_config=spec("ngram")) as llm:
        first = [[list(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        again = [[list(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        stats = llm.stats()
    assert_same(first, reference)
    assert_same(again, reference)
    assert stats.prefix_cache_hit_rate > 0
    assert stats.scheduler["spec_accepted_tokens"] > 0  # drafts were verified and kept, not only planned


def test_n_greater_than_one(checkpoint, prompts, reference):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    got, _ = generate(checkpoint, prompts[:8], params, speculative_config=spec("ngram"))
    assert got == [ref * 2 for ref in reference[:8]]


def test_seeded_sampling_equals_speculation_off(checkpoint, prompts):
    """Seeded rows draw each position's token with their (seed, position) variate, drafts
    or not: the outputs of speculation off, in any batch."""
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
    # Prompts holding most of the vocabulary, so that a sampled token is almost always
    # found in the context and prompt lookup proposes (the adaptive rule backs off after
    # lookups that find nothing: with short prompts a random model's samples may leave
    # no draft in 24 tokens).
    rng = np.random.default_rng(5)
    wide = [rng.permutation(np.arange(3, 500))[:400].tolist() for _ in range(6)]
    off, _ = generate(checkpoint, wide, params)
    first, stats = generate(checkpoint, wide, params, speculative_config=spec("ngram"))
    again, _ = generate(checkpoint, wide + prompts[10:12], params, speculative_config=spec("ngram"))
    assert first == off
    assert again[:6] == off
    assert stats.scheduler["spec_draft_tokens"] > 0  # the speculative path ran, not only the plain one


def test_structured_outputs_with_speculation(checkpoint, prompts):
    from pyengine.sampling_params import StructuredOutputsParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                            structured_outputs=StructuredOutputsParams(regex="[a-c]{4,12}"))
    off, _ = generate(checkpoint, prompts[:6], params)
    on, stats = generate(checkpoint, prompts[:6], params, speculative_config=spec("ngram"))
    assert on == off
    # Constrained sequences get no drafts (the grammar matcher cannot roll back, see
    # docs/speculative_decoding.md): the constraint holds because none is ever proposed.
    assert stats.scheduler["spec_draft_tokens"] == 0


def test_tensor_parallel_two(checkpoint, prompts, reference):
    got, stats = generate(checkpoint, prompts[:8], speculative_config=spec("ngram"), tensor_parallel_size=2)
    assert_same(got, reference[:8])
    assert stats.scheduler["spec_accepted_tokens"] > 0  # drafts crossed the plan broadcast and were kept


def test_a_failed_step_with_drafts_leaves_the_pool_whole(checkpoint, prompts):
    with LLM(str(checkpoint), speculative_config=spec("ngram")) as llm:
        install_faulty_runner(llm.engine_core).fail_after(6)
        with pytest.raises(EngineError, match="injected failure"):
            llm.generate(prompts[:8], GREEDY, use_tqdm=False)
        deadline = time.time() + 10
        while llm.stats().kv_usage > 0 and time.time() < deadline:
            time.sleep(0.05)
        assert llm.stats().kv_usage == 0.0
        outs = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)


@pytest.mark.parametrize("draft", ["target", "other"])
def test_a_draft_model_through_the_engine(checkpoint, prompts, reference, tmp_path_factory, draft):
    """Drafts the executor proposes (method "draft_model", the scheduler's "executor"):
    the target as its own draft is kept wholesale, another checkpoint's drafts mostly not;
    the outputs are those of speculation off either way."""
    folder = checkpoint if draft == "target" else make_tiny_checkpoint(
        tmp_path_factory.mktemp("draft") / "qwen3", "qwen3", seed=9)
    got, stats = generate(checkpoint, prompts[:12], num_kv_blocks=256, speculative_config={
        "method": "draft_model", "model": str(folder), "num_speculative_tokens": 3})
    assert_same(got, reference[:12])
    assert stats.scheduler["spec_draft_tokens"] > 0
    if draft == "target":
        assert stats.scheduler["spec_accepted_tokens"] == stats.scheduler["spec_draft_tokens"]
    assert stats.kv_usage == 0.0


def test_requests_whose_drafts_the_executor_refuses_are_never_proposed_for(checkpoint, prompts):
    """min_tokens (like bad_words and custom processors) makes the executor refuse every
    draft: the scheduler marks such requests no_spec and never runs the proposer for them."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, min_tokens=4)
    off, _ = generate(checkpoint, prompts[:6], params)
    on, stats = generate(checkpoint, prompts[:6], params, speculative_config=spec("ngram"))
    assert on == off
    assert stats.scheduler["spec_proposals"] == 0
    assert stats.scheduler["spec_draft_tokens"] == 0
