"""Greedy ``LLM.generate`` equals Hugging Face transformers' ``generate``, token for token,
under every scheduling regime the engine has (reference: the same checkpoint in
transformers)."""

from __future__ import annotations

import numpy as np
import pytest

from pyengine import LLM, SamplingParams
from pyengine.errors import InvalidRequestError
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.transformers_reference import reference_greedy_tokens

NUM_PROMPTS = 64
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("parity") / "qwen3", "qwen3", seed=3)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 500, 40).tolist()
    out = []
    for i in range(NUM_PROMPTS):
        body = rng.integers(3, 500, int(rng.integers(1, 60))).tolist()
        out.append(shared + body if i % 2 == 0 else body)
    return out


@pytest.fixture(scope="module")
def reference(checkpoint, prompts):
    return reference_greedy_tokens(checkpoint, prompts, MAX_TOKENS, ignore_eos=False)


def generate(checkpoint, prompts, max_tokens=MAX_TOKENS, **engine_args):
    """Greedy tokens of each prompt from an ``LLM`` with ``engine_args``, and its stats after."""
    with LLM(str(checkpoint), **engine_args) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        stats = llm.stats()
    return [o.outputs[0].token_ids for o in outs], stats


def assert_same(got, reference):
    mismatches = [i for i, (a, b) in enumerate(zip(got, reference)) if a != b]
    assert not mismatches, f"{len(mismatches)} prompts differ, first {mismatches[0]}: {got[mismatches[0]]} vs {reference[mismatches[0]]}"


def test_defaults_match_transformers_and_hit_the_prefix_cache(checkpoint, prompts, reference):
    got, stats = generate(checkpoint, prompts)
    assert_same(got, reference)
    assert stats.prefix_cache_hit_rate > 0, "half the prompts share a 40-token prefix"
    assert stats.kv_usage == 0.0


def test_tiny_kv_pool_preempts_and_matches(checkpoint, prompts, reference):
    got, stats = generate(checkpoint, prompts, num_kv_blocks=24, max_num_seqs=64)
    assert stats.preemptions > 0
    assert_same(got, reference)


def test_small_token_budget_chunks_prefill_and_matches(checkpoint, prompts, reference):
    got, stats = generate(checkpoint, prompts, max_num_batched_tokens=16, max_num_seqs=16,
                          long_prefill_token_threshold=8)
    assert stats.scheduler["prefill_tokens_scheduled"] > 0
    assert_same(got, reference)


def test_prefix_caching_off_matches(checkpoint, prompts, reference):
    got, stats = generate(checkpoint, prompts, enable_prefix_caching=False)
    assert stats.prefix_cache_hit_rate == 0
    assert_same(got, reference)


@pytest.mark.parametrize("depth", [1, 2])
def test_pipeline_depths_match(checkpoint, prompts, reference, depth):
    got, _ = generate(checkpoint, prompts, pipeline_depth=depth)
    assert_same(got, reference)


@pytest.mark.parametrize("max_num_seqs", [1, 64])
def test_batch_caps_match(checkpoint, prompts, reference, max_num_seqs):
    got, _ = generate(checkpoint, prompts[:16] if max_num_seqs == 1 else prompts, max_num_seqs=max_num_seqs)
    assert_same(got, reference[: len(got)])


def test_flash_attn_sized_blocks_on_cpu_match_and_share_prefixes(checkpoint):
    """Block size 256 (the default where flash-attn runs), checked on the CPU: a
    max_model_len that is not a multiple of it (the last block is partly usable), and a
    300-token shared prefix whose first full block is served from the prefix cache."""
    rng = np.random.default_rng(7)
    shared = rng.integers(3, 500, 300).tolist()
    batch = [shared + rng.integers(3, 500, int(rng.integers(1, 60))).tolist() for _ in range(4)]
    batch.append(rng.integers(3, 500, 30).tolist())
    reference = reference_greedy_tokens(checkpoint, batch, MAX_TOKENS, ignore_eos=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with LLM(str(checkpoint), block_size=256, max_model_len=400, max_num_seqs=8) as llm:
        first = llm.generate(batch[:1], params, use_tqdm=False)  # fills the shared prefix's first block
        rest = llm.generate(batch[1:], params, use_tqdm=False)
        stats = llm.stats()
        full = llm.generate([shared + shared[:99]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="exceeds max_model_len = 400"):
            llm.generate([shared + shared[:100]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    assert_same([o.outputs[0].token_ids for o in first + rest], reference)
    assert stats.prefix_cache_hit_rate > 0
    assert len(full[0].outputs[0].token_ids) == 1  # up to exactly max_model_len: 400 = 256 + 144
