"""Speculative decoding's scheduler half through the bindings: drafts in the plan,
results with accepted drafts, the event's tokens and sample indices, stop checks per
token, block accounting, the adaptive rule's counters and malformed results."""

from __future__ import annotations

import numpy as np
import pytest

from pyengine import InvalidConfigError, Request, Scheduler, SchedulerConfig, StepResultError


def make(num_blocks: int = 64, **kw) -> Scheduler:
    kw.setdefault("block_size", 4)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("max_model_len", 128)
    kw.setdefault("pipeline_depth", 1)
    kw.setdefault("num_speculative_tokens", 3)
    kw.setdefault("speculative_method", "ngram")
    kw.setdefault("spec_min_acceptance", 0.0)
    return Scheduler(SchedulerConfig(num_blocks, **kw))


def first_decode(s: Scheduler, prompt: list[int], sampled: int, **kw):
    s.add_request(Request("a", prompt, ignore_eos=kw.pop("ignore_eos", True), **kw))
    plan = s.schedule()
    s.apply_result(plan.step_id, [sampled])
    s.take_output(plan.step_id)
    return s.schedule()


def test_config_fields_and_refusals():
    c = SchedulerConfig(16, num_speculative_tokens=4, speculative_method="suffix", prompt_lookup_min=2,
                        prompt_lookup_max=5, spec_min_acceptance=0.3)
    assert (c.num_speculative_tokens, c.speculative_method, c.prompt_lookup_min, c.prompt_lookup_max) == \
        (4, "suffix", 2, 5)
    assert c.spec_min_acceptance == pytest.approx(0.3)
    assert SchedulerConfig(16).speculative_method == "none"
    for bad in ({"num_speculative_tokens": 2}, {"speculative_method": "ngram"},
                {"num_speculative_tokens": 2, "speculative_method": "medusa"},
                {"num_speculative_tokens": 2, "speculative_method": "ngram", "prompt_lookup_min": 4},
                {"num_speculative_tokens": 2, "speculative_method": "ngram", "spec_min_acceptance": -0.1}):
        with pytest.raises(InvalidConfigError):
            SchedulerConfig(16, **bad)


def test_drafts_in_the_plan_and_accepted_tokens_in_the_event():
    s = make()
    plan = first_decode(s, [1, 2, 3, 4, 5, 6, 1, 2], 3)
    assert plan.num_draft_tokens.dtype == np.int32 and plan.num_draft_tokens.tolist() == [3]
    assert plan.draft_token_ids.dtype == np.int64 and plan.draft_token_ids.tolist() == [4, 5, 6]
    assert plan.input_ids.tolist() == [3, 4, 5, 6]
    assert plan.logits_indices.tolist() == [0, 1, 2, 3] and plan.num_samples == 4
    s.apply_result(plan.step_id, np.array([4, 5, 8], dtype=np.int64), num_accepted=np.array([2], dtype=np.int32))
    ev = s.take_output(plan.step_id)
    assert ev.token_ids.tolist() == [4, 5, 8] and ev.seq_ids.tolist() == [0, 0, 0]
    assert ev.sample_indices.tolist() == [0, 1, 2]
    st = s.stats()
    assert (st["spec_drafts"], st["spec_draft_tokens"], st["spec_accepted_tokens"]) == (1, 3, 2)
    assert st["spec_accepted_per_position"] == [1, 1, 0]
    assert st["spec_mean_accepted_length"] == pytest.approx(3.0)
    s.check_invariants()
    nxt = s.schedule()
    assert nxt.input_ids[0] == 8 and nxt.positions[0] == 11


def test_plain_plans_carry_empty_draft_arrays():
    s = make(num_speculative_tokens=0, speculative_method="none")
    plan = first_decode(s, [1, 2, 3, 4, 5, 6, 1, 2], 3)
    assert plan.num_draft_tokens.size == 0 and plan.draft_token_ids.size == 0
    s.apply_result(plan.step_id, [7])
    assert s.take_output(plan.step_id).sample_indices.size == 0


def test_stop_inside_accepted_drafts_drops_the_rest_and_frees_everything():
    s = make()
    plan = first_decode(s, [1, 2, 3, 4, 5, 6, 1, 2], 3, ignore_eos=False, eos_token_ids=[5])
    s.apply_result(plan.step_id, [4, 5, 6, 9], num_accepted=[3])
    ev = s.take_output(plan.step_id)
    assert ev.token_ids.tolist() == [4, 5] and ev.finished_seq_ids.tolist() == [0]
    assert ev.stop_token_ids.tolist() == [5]
    st = s.stats()
    assert st["discarded_tokens"] == 2 and st["kv_blocks_used"] == 0
    s.check_invariants()


@pytest.mark.parametrize("sampled, accepted", [
    ([4], None),             # drafts but no num_accepted
    ([4, 5, 6, 7, 8], [4]),  # more accepted than drafted
    ([7, 9], [1]),           # an accepted token that is not the draft
    ([4, 5, 9], [1]),        # a count that does not add up
])
def test_malformed_results_are_refused(sampled, accepted):
    s = make()
    plan = first_decode(s, [1, 2, 3, 4, 5, 6, 1, 2], 3)
    kw = {} if accepted is None else {"num_accepted": accepted}
    with pytest.raises(StepResultError):
        s.apply_result(plan.step_id, sampled, **kw)
    s.apply_result(plan.step_id, [9], num_accepted=[0])  # nothing changed before the refusal
    s.check_invariants()


def test_executor_drafts_arrive_with_the_result():
    s = make(num_speculative_tokens=2, speculative_method="executor")
    s.add_request(Request("a", [1, 2, 3], max_tokens=10, ignore_eos=True))
    plan = s.schedule()
    s.apply_result(plan.step_id, [6], next_drafts=(np.array([2], dtype=np.int32), np.array([7, 8])))
    plan = s.schedule()
    assert plan.draft_token_ids.tolist() == [7, 8] and plan.input_ids.tolist() == [6, 7, 8]


def _accept_some(plan, rng) -> tuple[list[int], list[int]]:
    """A double of the executor: accepts a random number of each sequence's drafts."""
    counts = plan.num_draft_tokens.tolist() or [0] * len(plan.logits_indices)
    drafts = plan.draft_token_ids.tolist()
    sampled, accepted, at = [], [], 0
    for d in counts:
        a = int(rng.integers(0, d + 1))
        sampled += drafts[at:at + a] + [int(rng.integers(0, 6))]
        accepted.append(a)
        at += d
    return sampled, accepted


def test_random_acceptance_aborts_and_a_tiny_pool_leak_nothing():
    rng = np.random.default_rng(7)
    s = make(num_blocks=14, max_num_batched_tokens=24)
    for i in range(10):
        prompt = [int(t) for t in rng.integers(0, 6, size=int(rng.integers(3, 12)))]
        s.add_request(Request(f"r{i}", prompt, max_tokens=int(rng.integers(2, 20)), ignore_eos=True))
    emitted: dict[int, int] = {}
    for step in range(2000):
        plan = s.schedule()
        if plan is None:
            break
        if step % 17 == 5:
            s.abort(f"r{rng.integers(0, 10)}")
        sampled, accepted = _accept_some(plan, rng)
        if plan.num_draft_tokens.size:
            s.apply_result(plan.step_id, sampled, num_accepted=accepted)
        else:
            s.apply_result(plan.step_id, sampled)
        s.check_invariants()
        ev = s.take_output(plan.step_id)
        for seq in ev.seq_ids.tolist():
            emitted[seq] = emitted.get(seq, 0) + 1
    st = s.stats()
    assert not s.has_unfinished()
    assert st["kv_blocks_used"] == 0 and st["kv_blocks_free"] == 14
    assert st["spec_drafts"] > 0 and st["preemptions"] > 0
