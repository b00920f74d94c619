"""The draft model: proposals from a second checkpoint, verified by the target; greedy
outputs equal plain decoding whatever the draft proposes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

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


def test_the_draft_model_proposes_only_for_the_sequences_the_plan_names(target):
    """``propose_indices`` (the scheduler's: sequences that may draft) limits the proposal
    forwards to those rows; the others get a count of 0, the named ones the drafts they
    get when every sequence is proposed for."""
    outputs = []
    for named in (None, np.array([1, 3], dtype=np.int32)):
        runner = _runner(target, draft=target)
        proposed_rows: list[int] = []
        propose = runner.proposer.propose

        def recording(rows, *args, _propose=propose, _seen=proposed_rows):
            _seen.extend(np.asarray(rows).tolist())
            return _propose(rows, *args)

        runner.proposer.propose = recording
        planner = HandPlanner(num_blocks=runner.num_kv_blocks, max_rows=8)
        for p in PROMPTS:
            planner.add(p, GREEDY)
        plan = planner.next_plan()
        plan.propose_indices = named
        out = runner.execute(plan)
        outputs.append((out.next_drafts, sorted(proposed_rows), plan.sample_rows))
    (all_counts, all_tokens), all_rows, sample_rows = outputs[0]
    (counts, tokens), rows, _ = outputs[1]
    assert all_rows == sorted(np.asarray(sample_rows).tolist())
    assert rows == sorted(np.asarray(sample_rows)[[1, 3]].tolist()), "the draft ran for the named rows only"
    assert counts.tolist() == [0, K, 0, K]
    per_seq = np.split(all_tokens, np.cumsum(all_counts)[:-1])
    assert tokens.tolist() == per_seq[1].tolist() + per_seq[3].tolist()
    empty = HandPlanner(num_blocks=64, max_rows=8)
    empty.add(PROMPTS[0], GREEDY)
    plan = empty.next_plan()
    plan.propose_indices = np.zeros(0, dtype=np.int32)
    runner = _runner(target, draft=target)
    counts, tokens = runner.execute(plan).next_drafts
    assert counts.tolist() == [0] and len(tokens) == 0


def test_a_decode_step_whose_sequences_never_draft_again_costs_the_draft_nothing(target):
    """Once the plan names no sequence that may draft (``may_draft_indices`` and
    ``propose_indices`` empty) and no row is in its prompt, the draft neither mirrors nor
    proposes, and the runner hands back None for the next drafts (none for anyone)."""
    runner = _runner(target, draft=target)
    calls: list[str] = []
    for name in ("mirror", "propose"):
        original = getattr(runner.proposer, name)
        setattr(runner.proposer, name, lambda *a, _o=original, _n=name, **k: (calls.append(_n), _o(*a, **k))[1])
    planner = HandPlanner(num_blocks=runner.num_kv_blocks, max_rows=8)
    for p in PROMPTS[:2]:
        planner.add(p, GREEDY)
    nobody = np.zeros(0, dtype=np.int32)
    for step in range(3):
        plan = planner.next_plan()
        plan.may_draft_indices, plan.propose_indices = nobody, nobody
        calls.clear()
        out = runner.execute(plan)
        planner.record(plan, out.sampled_token_ids)
        if step == 0:  # the prompts are mirrored whatever drafts later (a prefix hit may share them)
            assert calls == ["mirror"] and out.next_drafts[0].tolist() == [0, 0]
        else:
            assert calls == [] and out.next_drafts is None


def test_propose_counts_of_another_length_than_propose_indices_are_refused(target):
    """One cap per named sequence: a plan whose ``propose_counts`` does not match its
    ``propose_indices`` is a planner's bug, refused rather than read as "k for all"."""
    planner = HandPlanner(num_blocks=64, max_rows=8)
    for p in PROMPTS[:2]:
        planner.add(p, GREEDY)
    plan = planner.next_plan()
    plan.propose_indices = np.array([0, 1], dtype=np.int32)
    plan.propose_counts = np.array([1], dtype=np.int32)
    with pytest.raises(ValueError, match="propose_counts"):
        _runner(target, draft=target).execute(plan)


def test_the_draft_model_keeps_no_cache_for_the_outputs_of_sequences_that_never_draft(target):
    """``may_draft_indices``: a row outside it has its prompt mirrored (prefix-cache hits may
    reuse it) but not its outputs; the other rows' drafts are those of a full mirror."""
    results = []
    for restricted in (False, True):
        runner = _runner(target, draft=target)
        planner = HandPlanner(num_blocks=runner.num_kv_blocks, max_rows=8)
        ids = [planner.add(p, GREEDY) for p in PROMPTS[:2]]
        drafts, written = [], []
        for _ in range(3):
            plan = planner.next_plan()
            if restricted:
                plan.may_draft_indices = np.array([1], dtype=np.int32)
            cache = runner.proposer.kv_cache
            before = cache.keys.clone()
            out = runner.execute(plan)
            planner.record(plan, out.sampled_token_ids)
            counts, tokens = out.next_drafts
            drafts.append(tokens[counts[0]:].tolist())  # the second sequence's
            position = int(plan.positions[plan.query_start_loc[0]])
            block = int(runner.batch.block_table[int(plan.rows[0]), position // 16])
            written.append(not torch.equal(cache.keys[:, block, position % 16], before[:, block, position % 16]))
        results.append((drafts, written, [planner.output_tokens(i) for i in ids]))
    (full_drafts, full_written, full_out), (drafts, written, out) = results
    assert drafts == full_drafts and out == full_out
    assert full_written == [True, True, True]
    assert written == [True, False, False], "the prompt, then no outputs of the first sequence"
