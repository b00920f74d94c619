"""The executor's proposers at tensor_parallel_size=2: the draft model and the EAGLE-3
head run on rank 0 only, their drafts reach the worker with the next step's plan, and
the greedy outputs equal speculation off at two ranks and the same speculation at one,
with and without preemption; rank 0's KV sizing pays for the proposer's cache; a
proposer that does not fit is refused before any worker starts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pyengine import LLM, SamplingParams
from pyengine.errors import InvalidConfigError
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.eagle3_checkpoint import write_eagle3_head

K = 3
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256)
SMALL_POOL = dict(num_kv_blocks=12, block_size=16, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    # A vocabulary that does not split evenly: the last rank's slice is padded.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("target") / "llama", "llama", seed=1,
                                num_hidden_layers=4, vocab_size=509)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("draft") / "qwen3", "qwen3", seed=5, vocab_size=509)


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    """A head sharing the target's embedding (gathered whole on rank 0 at two ranks)."""
    return write_eagle3_head(tmp_path_factory.mktemp("head") / "eagle3", target, seed=2, draft_vocab_size=300,
                             aux_layer_ids=(0, 1, 3))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(4)
    return [rng.integers(3, 509, int(rng.integers(4, 40))).tolist() for _ in range(6)]


def generate(target, prompts, tp, **engine):
    with LLM(str(target), tensor_parallel_size=tp, **{**ENGINE, **engine}) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = llm.stats()
    return [list(o.outputs[0].token_ids) for o in outs], stats


@pytest.fixture(scope="module")
def plain(target, prompts):
    return generate(target, prompts, 2)[0]


def draft(model) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": K}


def eagle(model) -> dict:
    return {"method": "eagle3", "model": str(model), "num_speculative_tokens": K}


def test_the_target_as_its_own_draft_is_always_right_at_two_ranks(target, prompts, plain):
    got, stats = generate(target, prompts, 2, speculative_config=draft(target))
    assert got == plain
    s = stats.scheduler
    assert s["spec_draft_tokens"] > 0 and s["spec_accepted_tokens"] == s["spec_draft_tokens"]
    assert s["spec_mean_accepted_length"] > 1.5
    assert stats.kv_usage == 0.0


def test_another_draft_model_at_two_ranks_equals_one_rank_and_preempts(target, other_draft, prompts, plain):
    got, stats = generate(target, prompts, 2, speculative_config=draft(other_draft), **SMALL_POOL)
    assert got == plain
    assert stats.preemptions > 0 and stats.scheduler["spec_draft_tokens"] > 0 and stats.kv_usage == 0.0
    one, _ = generate(target, prompts, 1, speculative_config=draft(other_draft), **SMALL_POOL)
    assert one == got


def test_eagle3_at_two_ranks_equals_one_rank_and_speculation_off(target, head, prompts, plain):
    got, stats = generate(target, prompts, 2, speculative_config=eagle(head))
    assert got == plain
    assert stats.scheduler["spec_drafts"] > 0 and stats.scheduler["spec_draft_tokens"] > 0
    one, one_stats = generate(target, prompts, 1, speculative_config=eagle(head))
    assert one == got
    # The same head over the same target states: the same drafts at one rank and two.
    assert one_stats.scheduler["spec_draft_tokens"] == stats.scheduler["spec_draft_tokens"]
    assert one_stats.scheduler["spec_accepted_tokens"] == stats.scheduler["spec_accepted_tokens"]


def test_eagle3_at_two_ranks_with_preemption(target, head, prompts, plain):
    got, stats = generate(target, prompts, 2, speculative_config=eagle(head), **SMALL_POOL)
    assert got == plain
    assert stats.preemptions > 0 and stats.kv_usage == 0.0


def test_rank_zero_sizes_the_cache_for_the_draft_beside_its_shard(target, other_draft, prompts):
    budget = 1 << 20
    _, alone = generate(target, prompts[:1], 2, kv_cache_bytes=budget, block_size=16)
    _, with_draft = generate(target, prompts[:1], 2, kv_cache_bytes=budget, block_size=16,
                             speculative_config=draft(other_draft))
    t, d = (json.loads((path / "config.json").read_text()) for path in (target, other_draft))

    def per_block(config, ranks):  # keys + values of every layer, float32, 16-token blocks
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        return 2 * config["num_hidden_layers"] * 16 * (config["num_key_value_heads"] // ranks) * head_dim * 4

    scratch = ENGINE["max_num_seqs"] * (-(-(K + 16) // 16) + 1)
    assert alone.kv_blocks_total == budget // per_block(t, 2)
    assert with_draft.kv_blocks_total == (budget - scratch * per_block(d, 1)) // (per_block(t, 2) + per_block(d, 1))


def test_a_proposer_that_does_not_fit_is_refused_before_the_workers_start(target, head, tmp_path, monkeypatch):
    from pyengine.executor.tensor_parallel import runner

    def no_worker(*args, **kwargs):
        raise AssertionError("a worker was started for a proposer that does not fit")

    monkeypatch.setattr(runner, "_spawn", no_worker)
    wrong = make_tiny_checkpoint(tmp_path / "wrong", "qwen3", vocab_size=300)
    with pytest.raises(InvalidConfigError, match="share the target's vocabulary"):
        LLM(str(target), tensor_parallel_size=2, **ENGINE, speculative_config=draft(wrong))
    bad_head = write_eagle3_head(tmp_path / "bad", target, aux_layer_ids=(0, 1, 3))
    config = json.loads((bad_head / "config.json").read_text())
    (bad_head / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
    with pytest.raises(InvalidConfigError, match="hidden_size must be the target's"):
        LLM(str(target), tensor_parallel_size=2, **ENGINE, speculative_config=eagle(bad_head))
