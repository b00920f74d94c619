"""Greedy ``LLM.generate`` of the mixture-of-experts families equals transformers'
``generate`` through the whole engine: batched with prefix caching, and with a KV pool
so small that sequences are preempted and recomputed."""

from __future__ import annotations

import numpy as np
import pytest
from test_engine_parity import assert_same, generate

from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.transformers_reference import reference_greedy_tokens

MAX_TOKENS = 20


@pytest.fixture(scope="module", params=["qwen2_moe", "mixtral"])
def checkpoint(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=3)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 500, 40).tolist()
    return [(shared if i % 2 == 0 else []) + rng.integers(3, 500, int(rng.integers(1, 40))).tolist()
            for i in range(16)]


@pytest.fixture(scope="module")
def reference(checkpoint, prompts):
    return reference_greedy_tokens(checkpoint, prompts, MAX_TOKENS, ignore_eos=False)


def test_batched_generate_matches_transformers(checkpoint, prompts, reference):
    got, stats = generate(checkpoint, prompts)
    assert_same(got, reference)
    assert stats.prefix_cache_hit_rate > 0


def test_tiny_kv_pool_preempts_and_matches(checkpoint, prompts, reference):
    got, stats = generate(checkpoint, prompts, num_kv_blocks=12, max_num_seqs=16)
    assert stats.preemptions > 0
    assert_same(got, reference)
