"""N-gram speculation at tensor_parallel_size=2: the plan's drafts reach the worker
(shared segment), rank 0 verifies, and the greedy tokens equal those without drafts."""

from __future__ import annotations

import numpy as np

from pyengine import LLM, SamplingParams
from pyengine.testing.checkpoints import make_tiny_checkpoint

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256, tensor_parallel_size=2)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_greedy_tokens_at_two_ranks_equal_decoding_without_drafts(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "qwen3")
    rng = np.random.default_rng(0)
    span = rng.integers(3, 400, 12).tolist()
    batch = [span + rng.integers(3, 400, 4).tolist() + span[:6] for _ in range(4)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    runs = {}
    for name, extra in (("plain", {}), ("ngram", {"speculative_config": NGRAM})):
        with LLM(str(path), **ENGINE, **extra) as llm:
            runs[name] = [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]
            stats = llm.stats().scheduler
    assert stats["spec_drafts"] > 0 and stats["spec_accepted_tokens"] > 0
    assert stats["kv_blocks_used"] == 0
    assert runs["ngram"] == runs["plain"]
