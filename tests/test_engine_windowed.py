"""Greedy ``LLM.generate`` of sliding-window models equals transformers', token for token,
under the scheduler's regimes: prompts and generations longer than the window, prefix-cache
hits that end inside and beyond the window, chunked prefill across the window's edge, and
preemption (recomputation) past it. Mistral's window covers every layer, so the scheduler
frees its blocks behind the window as it runs (a prefix hit then resumes from the cached
window only); Gemma 2 is hybrid: per-group block tables, its windowed layers' table
freeing behind the window while the full layer's keeps every block
(``test_engine_hybrid_tables.py`` checks the counts)."""

from __future__ import annotations

import numpy as np
import pytest
from test_engine_parity import assert_same, generate

from pyengine import LLM, SamplingParams
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.transformers_reference import reference_greedy_tokens

MAX_TOKENS = 30  # past the 20-token window from every prompt
# Block tables per sequence: Gemma 2's 3 layers (sliding, full, sliding) are 3 tables of
# one layer, each block holding one layer's KV.
TABLES = {"mistral_window": 1, "gemma2": 3}


@pytest.fixture(scope="module", params=["mistral_window", "gemma2"])
def checkpoint(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=5)


@pytest.fixture(scope="module")
def prompts():
    """16 prompts: a quarter share a 48-token prefix (a hit of 3 blocks, beyond the window),
    a quarter a 16-token one (a hit of one block, inside it), the rest unrelated."""
    rng = np.random.default_rng(1)
    long_prefix, short_prefix = rng.integers(3, 500, 48).tolist(), rng.integers(3, 500, 16).tolist()
    out = []
    for i in range(16):
        body = rng.integers(3, 500, int(rng.integers(2, 50))).tolist()
        out.append([long_prefix, short_prefix, [], []][i % 4] + body)
    return out


@pytest.fixture(scope="module")
def reference(checkpoint, prompts):
    return reference_greedy_tokens(checkpoint, prompts, MAX_TOKENS, ignore_eos=False)


def test_prefix_hits_inside_and_beyond_the_window_match(checkpoint, prompts, reference):
    with LLM(str(checkpoint), block_size=16) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        first = llm.generate(prompts[:2], params, use_tqdm=False)  # caches both shared prefixes
        rest = llm.generate(prompts[2:], params, use_tqdm=False)
        stats = llm.stats()
    assert_same([o.outputs[0].token_ids for o in first + rest], reference)
    assert stats.prefix_cache_hit_rate > 0


def test_chunked_prefill_across_the_window_edge_matches(checkpoint, prompts, reference):
    got, stats = generate(checkpoint, prompts, MAX_TOKENS, max_num_batched_tokens=16, max_num_seqs=8,
                          long_prefill_token_threshold=8, block_size=16)
    assert stats.scheduler["prefill_tokens_scheduled"] > 0
    assert_same(got, reference)


def test_preemption_past_the_window_matches(checkpoint, prompts, reference, request):
    tables = TABLES[request.node.callspec.params["checkpoint"]]
    got, stats = generate(checkpoint, prompts, MAX_TOKENS, num_kv_blocks=12 * tables, max_num_seqs=16, block_size=16)
    assert stats.preemptions > 0
    assert_same(got, reference)
