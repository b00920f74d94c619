"""The model runner verifies drafts: greedy tokens identical to decoding without them.

Plans come from the hand planner (``next_plan(drafts=...)``); drafts are the reference
run's own continuation, some corrupted, so how many a step must keep is known exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner
from pyengine.executor.rejection_sampler import DraftPlanError
from pyengine.sampling_params import SamplingParams
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.hand_plan import HandPlanner

VOCAB = 512
STEPS = 14
K = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def _runner(path, **overrides) -> ModelRunner:
    settings = dict(max_num_seqs=8, max_model_len=256, num_kv_blocks=128)
    settings.update(overrides)
    return ModelRunner.from_pretrained(path, ExecutorConfig(**settings))


def _prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, size=length).tolist()


def _reference(path, prompts, params):
    """Plain decoding: each sequence's STEPS tokens and their logprobs (when asked)."""
    runner, planner = _runner(path), HandPlanner(num_blocks=128, max_rows=8)
    ids = [planner.add(p, q) for p, q in zip(prompts, params)]
    logprobs: dict[int, list[float]] = {i: [] for i in ids}
    for _ in range(STEPS):
        plan = planner.next_plan()
        out = runner.execute(plan)
        if out.logprobs is not None:
            for seq_id, value in zip(out.sampled_seq_ids.tolist(), out.logprobs.sampled_logprobs.tolist()):
                logprobs[seq_id].append(value)
        planner.record(plan, out.sampled_token_ids)
    return [planner.output_tokens(i) for i in ids], [logprobs[i] for i in ids]


def _speculate(path, prompts, params, reference, corrupt):
    """Decoding with K drafts a step taken from ``reference``, draft j of sequence i at
    step s replaced by a wrong token when ``corrupt(i, s, j)``; checks every step keeps
    exactly the right drafts. Returns the tokens, their logprobs and the drafts kept."""
    runner, planner = _runner(path), HandPlanner(num_blocks=128, max_rows=8)
    ids = [planner.add(p, q) for p, q in zip(prompts, params)]
    logprobs: dict[int, list[float]] = {i: [] for i in ids}
    plan = planner.next_plan()  # the prefill: no drafts
    out = runner.execute(plan)
    if out.logprobs is not None:
        for seq_id, value in zip(out.sampled_seq_ids.tolist(), out.logprobs.sampled_logprobs.tolist()):
            logprobs[seq_id].append(value)
    planner.record(plan, out.sampled_token_ids)
    kept_total, step = 0, 0
    while min(len(planner.output_tokens(i)) for i in ids) < STEPS:
        drafts, expected = {}, []
        for i, seq_id in enumerate(ids):
            done = len(planner.output_tokens(seq_id))
            truth = reference[i][done:done + K]
            proposal = [(t + 1) % VOCAB if corrupt(i, step, j) else t for j, t in enumerate(truth)]
            drafts[seq_id] = proposal
            expected.append(next((j for j, (a, b) in enumerate(zip(proposal, truth)) if a != b), len(proposal)))
        plan = planner.next_plan(drafts=drafts)
        out = runner.execute(plan)
        assert out.row_errors is None
        assert out.num_accepted.tolist() == expected
        if out.logprobs is not None:
            assert len(out.sampled_seq_ids) == len(out.sampled_token_ids)
            for seq_id, value in zip(out.sampled_seq_ids.tolist(), out.logprobs.sampled_logprobs.tolist()):
                logprobs[seq_id].append(value)
        planner.record(plan, out.sampled_token_ids, out.num_accepted)
        kept_total += int(out.num_accepted.sum())
        step += 1
    return [planner.output_tokens(i)[:STEPS] for i in ids], [logprobs[i][:STEPS] for i in ids], kept_total


def _corrupt_some(i: int, step: int, j: int) -> bool:
    return (i + step) % 3 == 0 and j == (step % K)


PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=64),
    "penalties": SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4,
                                presence_penalty=0.2, max_tokens=64),
    "logit_bias": SamplingParams(temperature=0.0, logit_bias={7: 3.0, 11: -100.0}, max_tokens=64),
    "logprobs": SamplingParams(temperature=0.0, logprobs=2, max_tokens=64),
    # Seeded sampling: the draws are the (seed, position) variates the plain run uses.
    "seeded": SamplingParams(temperature=0.9, top_p=0.95, top_k=60, seed=1234, max_tokens=64),
    "seeded_penalties": SamplingParams(temperature=1.1, min_p=0.01, repetition_penalty=1.2, seed=99,
                                       logprobs=1, max_tokens=64),
}


@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_speculation_matches_plain_decoding(checkpoint, kind):
    """Greedy and seeded rows emit exactly the plain run's tokens, keeping exactly the
    drafts that equal them."""
    prompts = [_prompt(10 + i, 9 + 7 * i) for i in range(4)]
    params = [PARAMS[kind]] * len(prompts)
    reference, ref_logprobs = _reference(checkpoint, prompts, params)
    tokens, logprobs, kept = _speculate(checkpoint, prompts, params, reference, _corrupt_some)
    assert tokens == reference
    assert kept > 0
    if PARAMS[kind].logprobs is not None:
        np.testing.assert_allclose(np.concatenate(logprobs), np.concatenate(ref_logprobs), atol=1e-4)


def test_rows_whose_processors_follow_the_output_refuse_their_drafts(checkpoint):
    """min_tokens depends on the output so far: drafts are refused, the tokens are exact."""
    prompts = [_prompt(30 + i, 12) for i in range(2)]
    params = [SamplingParams(temperature=0.0, min_tokens=5, max_tokens=64), PARAMS["greedy"]]
    reference, _ = _reference(checkpoint, prompts, params)
    runner, planner = _runner(checkpoint), HandPlanner(num_blocks=128, max_rows=8)
    ids = [planner.add(p, q) for p, q in zip(prompts, params)]
    plan = planner.next_plan()
    planner.record(plan, runner.execute(plan).sampled_token_ids)
    for _ in range(3):  # (the reference's STEPS tokens last the greedy row 3 steps of K + 1)
        drafts = {seq_id: reference[i][len(planner.output_tokens(seq_id)):][:K] for i, seq_id in enumerate(ids)}
        plan = planner.next_plan(drafts=drafts)
        out = runner.execute(plan)
        assert out.num_accepted.tolist() == [0, K]
        planner.record(plan, out.sampled_token_ids, out.num_accepted)
    for i, seq_id in enumerate(ids):
        produced = planner.output_tokens(seq_id)
        assert produced == reference[i][:len(produced)]


def test_seeded_sampling_with_drafts_is_the_same_in_any_batch(checkpoint):
    """A seeded request with (mostly wrong) drafts, alone or among unseeded companions,
    with another engine seed: the tokens of its plain run."""
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=64)
    prompt = _prompt(50, 15)
    plain = _reference(checkpoint, [prompt], [seeded])[0][0]

    def run(engine_seed: int, companions: int) -> list[int]:
        runner, planner = _runner(checkpoint, seed=engine_seed), HandPlanner(num_blocks=128, max_rows=8)
        for c in range(companions):
            planner.add(_prompt(60 + c, 8 + c), SamplingParams(temperature=1.0))
        seq_id = planner.add(prompt, seeded)
        plan = planner.next_plan()
        planner.record(plan, runner.execute(plan).sampled_token_ids)
        for step in range(6):
            done = len(planner.output_tokens(seq_id))
            drafts = [5, 6, 7] if step % 2 else plain[done:done + 2] + [7]
            plan = planner.next_plan(drafts={seq_id: drafts})
            out = runner.execute(plan)
            planner.record(plan, out.sampled_token_ids, out.num_accepted)
        return planner.output_tokens(seq_id)

    alone = run(1, 0)
    assert alone == plain[:len(alone)]
    assert run(2, 3) == alone


def test_a_plan_whose_drafts_disagree_with_its_entries_is_refused(checkpoint):
    runner, planner = _runner(checkpoint), HandPlanner(num_blocks=128, max_rows=8)
    seq_id = planner.add(_prompt(70, 10))
    plan = planner.next_plan()
    planner.record(plan, runner.execute(plan).sampled_token_ids)
    plan = planner.next_plan(drafts={seq_id: [1, 2]})
    plan.num_draft_tokens = np.array([3], dtype=np.int32)
    with pytest.raises(DraftPlanError):
        runner.execute(plan)


def test_a_sequence_whose_verification_fails_fails_alone(checkpoint):
    """The batched verdict raises; redone sequence by sequence, only the guilty one is
    reported and the others keep their exact tokens."""
    prompts = [_prompt(80 + i, 10 + i) for i in range(3)]
    params = [PARAMS["greedy"]] * 3
    reference, _ = _reference(checkpoint, prompts, params)
    runner, planner = _runner(checkpoint), HandPlanner(num_blocks=128, max_rows=8)
    ids = [planner.add(p, q) for p, q in zip(prompts, params)]
    plan = planner.next_plan()
    planner.record(plan, runner.execute(plan).sampled_token_ids)
    guilty_row = planner._sequences[ids[1]].row
    verify = runner.verifier.verify

    def failing(logits, layout, entry_rows, *args, **kwargs):
        if guilty_row in entry_rows.tolist():
            raise RuntimeError("injected verification failure")
        return verify(logits, layout, entry_rows, *args, **kwargs)

    runner.verifier.verify = failing
    drafts = {seq_id: reference[i][1:1 + K] for i, seq_id in enumerate(ids)}
    plan = planner.next_plan(drafts=drafts)
    out = runner.execute(plan)
    assert set(out.row_errors) == {ids[1]}
    assert "injected verification failure" in out.row_errors[ids[1]]
    assert out.num_accepted.tolist() == [K, 0, K]
    planner.record(plan, out.sampled_token_ids, out.num_accepted)
    for i in (0, 2):
        assert planner.output_tokens(ids[i]) == reference[i][:K + 2]


class _ReadyMask:
    """A grammar mask already computed: the same allowed tokens for every masked entry."""

    def __init__(self, allowed: np.ndarray, rows: int) -> None:
        words = np.zeros((rows, -(-VOCAB // 32)), dtype=np.uint32)
        for token in np.flatnonzero(allowed):
            words[:, token // 32] |= np.uint32(1 << (token % 32))
        self.bits = words

    def take(self, timeout: float = 30.0):
        return self.bits, 0.0


def _masked(plan, allowed: np.ndarray):
    entries = len(plan.logits_indices)
    plan.mask_sample_indices = np.arange(entries, dtype=np.int32)
    plan.grammar_mask = _ReadyMask(allowed, entries)
    return plan


def test_grammar_masks_apply_per_entry_and_no_illegal_draft_is_kept(checkpoint):
    """A constraint bans every token the unconstrained run chose: drafted anyway, they are
    all refused, and the constrained run's own drafts are all kept."""
    prompt, params = _prompt(90, 14), PARAMS["greedy"]
    unconstrained = _reference(checkpoint, [prompt], [params])[0][0]
    allowed = np.ones(VOCAB, dtype=bool)
    allowed[unconstrained] = False

    def decode(drafts_from):
        runner, planner = _runner(checkpoint), HandPlanner(num_blocks=128, max_rows=8)
        seq_id = planner.add(prompt, params)
        plan = _masked(planner.next_plan(), allowed)
        planner.record(plan, runner.execute(plan).sampled_token_ids)
        kept = []
        while len(planner.output_tokens(seq_id)) < STEPS - K and drafts_from is not None:
            done = len(planner.output_tokens(seq_id))
            plan = _masked(planner.next_plan(drafts={seq_id: drafts_from[done:done + K]}), allowed)
            out = runner.execute(plan)
            assert out.row_errors is None
            kept += out.num_accepted.tolist()
            planner.record(plan, out.sampled_token_ids, out.num_accepted)
        while drafts_from is None and len(planner.output_tokens(seq_id)) < STEPS:
            plan = _masked(planner.next_plan(), allowed)
            planner.record(plan, runner.execute(plan).sampled_token_ids)
        return planner.output_tokens(seq_id), kept

    constrained, _ = decode(None)
    assert not set(constrained) & set(unconstrained)
    refused, kept = decode(unconstrained)
    assert refused == constrained[:len(refused)] and set(kept) == {0}
    followed, kept = decode(constrained)
    assert followed == constrained[:len(followed)] and set(kept) == {K}
