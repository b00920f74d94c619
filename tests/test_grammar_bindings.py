"""The grammar bindings with the scheduler alone (no model): a vocabulary of a few
tokens, real llguidance matchers, masks through the plan's ticket, the dead end."""

from __future__ import annotations

import numpy as np
import pytest

from pyengine import (
    FINISH_REASONS,
    InvalidConfigError,
    InvalidRequestError,
    Request,
    Scheduler,
    SchedulerConfig,
)
from pyengine._sched import GrammarCompiler

# ids: 0 "a", 1 "b", 2 "c", 3 "ab", 4 EOS; logits width 40 (ids 5..39 have no bytes).
TOKENS = [b"a", b"b", b"c", b"ab", b"<eos>"]
EOS = 4


def compiler() -> GrammarCompiler:
    return GrammarCompiler(TOKENS, [], [EOS], 40)


def allowed(bits: np.ndarray, row: int) -> list[int]:
    return [t for t in range(bits.shape[1] * 32) if bits[row, t // 32] >> np.uint32(t % 32) & 1]


def drive(s: Scheduler, pick):
    """Runs to completion at depth 1, sampling ``pick(allowed_tokens)``; returns the tokens
    and finish reasons."""
    tokens, reasons = [], []
    while s.has_unfinished():
        plan = s.schedule()
        bits, compute_s = plan.grammar_mask.take(1.0)
        assert bits.dtype == np.uint32 and bits.shape == (1, 2) and compute_s >= 0
        s.apply_result(plan.step_id, np.array([pick(allowed(bits, 0))], dtype=np.int64))
        ev = s.take_output(plan.step_id)
        tokens += ev.token_ids.tolist()
        reasons += [FINISH_REASONS[r] for r in ev.finish_reasons]
    return tokens, reasons


def test_masks_follow_the_grammar_and_completion_stops():
    s = Scheduler(SchedulerConfig(16, block_size=4, max_model_len=64))
    c = compiler().compile("regex", "ab?c")
    s.add_request(Request("r", [0, 1], max_tokens=10, constraint=c))
    seen = []
    tokens, reasons = drive(s, lambda options: (seen.append(options), options[-1])[1])
    assert seen[0] == [0, 3], "a, or ab"
    assert tokens == [3, 2] and reasons == ["stop"]


def test_eos_is_allowed_where_the_grammar_may_end_and_is_the_stop_token():
    s = Scheduler(SchedulerConfig(16, block_size=4, max_model_len=64))
    s.add_request(Request("r", [0], max_tokens=10, eos_token_ids=[EOS], constraint=compiler().compile("regex", "a+")))
    tokens, reasons = drive(s, lambda options: EOS if EOS in options else options[0])
    assert tokens == [0, EOS] and reasons == ["stop"]


def test_a_dead_end_ends_the_sequence_without_an_invalid_token():
    # "ab?c" spelled as "a", "b": "c" is a token, but the grammar "abd" needs a "d" that no
    # token has, after a prefix the vocabulary can spell.
    s = Scheduler(SchedulerConfig(16, block_size=4, max_model_len=64))
    s.add_request(Request("r", [0], max_tokens=10, constraint=compiler().compile("regex", "abd")))
    tokens, reasons = drive(s, lambda options: options[0])
    assert reasons == ["dead_end"]
    assert tokens in ([0, 1], [3]), tokens
    assert s.stats()["grammar_dead_ends"] == 1
    assert s.stats()["kv_blocks_used"] == 0


def test_unconstrained_plans_carry_no_ticket_and_bad_inputs_are_typed_errors():
    s = Scheduler(SchedulerConfig(16, block_size=4, max_model_len=64))
    s.add_request(Request("r", [0], max_tokens=2))
    plan = s.schedule()
    assert plan.grammar_mask is None and plan.mask_sample_indices.size == 0
    with pytest.raises(InvalidRequestError, match="unknown kind"):
        compiler().compile("yaml", "a: 1")
    with pytest.raises(InvalidRequestError, match="takes no output constraint"):
        s.add_request(Request("p", [0], pooling=True, constraint=compiler().compile("regex", "a")))
    with pytest.raises(InvalidConfigError, match="no end-of-sequence"):
        GrammarCompiler(TOKENS, [], [], 40)
    with pytest.raises(InvalidConfigError, match="outside the vocabulary"):
        GrammarCompiler(TOKENS, [], [99], 40)


def test_special_tokens_are_never_spelled_as_text():
    tokens = [b"<", b"x", b">", b"<x>"]
    c = GrammarCompiler(tokens, [3], [3], 8).compile("regex", "<x>")
    s = Scheduler(SchedulerConfig(16, block_size=4, max_model_len=64))
    s.add_request(Request("r", [0], max_tokens=5, constraint=c))
    plan = s.schedule()
    bits, _ = plan.grammar_mask.take(1.0)
    assert allowed(bits, 0) == [0], "only '<': the special token <x> is not the text <x>"


def test_a_mask_that_does_not_come_is_a_bounded_wait_and_a_typed_error():
    from pyengine import StepResultError

    s = Scheduler(SchedulerConfig(16, block_size=4, max_model_len=64, pipeline_depth=2))
    s.add_request(Request("r", [0], max_tokens=5, constraint=compiler().compile("regex", "a+")))
    first, second = s.schedule(), s.schedule()
    assert first.grammar_mask.take(1.0)[0].shape == (1, 2)
    with pytest.raises(StepResultError, match="did not arrive within 0.05 s"):
        second.grammar_mask.take(0.05)  # step 0 has not reported: its mask cannot exist yet
    s.apply_result(first.step_id, np.array([0], dtype=np.int64))
    assert allowed(second.grammar_mask.take(1.0)[0], 0) == [0, EOS]
