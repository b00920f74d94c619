"""The draft model: proposals from a second checkpoint, verified by the target; greedy
outputs equal plain decoding whatever the draft proposes."""

from __future__ import annotations

import numpy as np
import pytest

from pyengine.errors import InvalidConfigError
from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner
from pyengine.sampling_params import SamplingParams
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.hand_plan import HandPlanner

VOCAB = 512
K = 3
TOKENS = 20


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=1)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("draft"), "qwen3", seed=5)


def _runner(path, draft=None) -> ModelRunner:
    spec = None if draft is None else {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}
    return ModelRunner.from_pretrained(path, ExecutorConfig(max_num_seqs=8, max_model_len=256, num_kv_blocks=64,
                                                            speculative_config=spec))


PROMPTS = [np.random.default_rng(i).integers(0, VOCAB, 5 + 9 * i).tolist() for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def _decode(runner: ModelRunner) -> tuple[list[list[int]], list[int]]:
    """Decode TOKENS per prompt, each step taking the drafts the previous one proposed."""
    planner = HandPlanner(num_blocks=runner.num_kv_blocks, max_rows=8)
    ids = [planner.add(p, GREEDY) for p in PROMPTS]
    drafts: dict[int, list[int]] = {}
    accepted: list[int] = []
    while min(len(planner.output_tokens(i)) for i in ids) < TOKENS:
        plan = planner.next_plan(drafts=drafts) if runner.proposer is not None else planner.next_plan()
        out = runner.execute(plan)
        assert out.row_errors is None
        planner.record(plan, out.sampled_token_ids, out.num_accepted)
        if out.num_accepted is not None:
            accepted += out.num_accepted.tolist()
        drafts = {}
        if out.next_drafts is not None:
            counts, tokens = out.next_drafts
            offsets = np.concatenate([[0], np.cumsum(counts)])
            for n, seq_id in enumerate(ids):  # every sequence samples each step, in seq id order
                drafts[seq_id] = tokens[offsets[n]:offsets[n + 1]].tolist()
    return [planner.output_tokens(i)[:TOKENS] for i in ids], accepted


@pytest.fixture(scope="module")
def reference(target):
    return _decode(_runner(target))[0]


def test_the_target_as_its_own_draft_is_always_right(target, reference):
    tokens, accepted = _decode(_runner(target, draft=target))
    assert tokens == reference
    assert accepted and all(a == K for a in accepted)


def test_another_draft_model_keeps_the_outputs_exact(target, other_draft, reference):
    tokens, accepted = _decode(_runner(target, draft=other_draft))
    assert tokens == reference
    assert accepted  # steps carried drafts


def test_a_draft_with_another_vocabulary_is_refused(target, tmp_path):
    wrong = make_tiny_checkpoint(tmp_path / "wrong", "qwen3", vocab_size=300)
    with pytest.raises(InvalidConfigError, match="share the target's vocabulary"):
        _runner(target, draft=wrong)
