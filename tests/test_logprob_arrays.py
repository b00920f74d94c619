"""The engine's log-probability arrays, the maps built from them at the edge, and the
running totals every consumer of deltas keeps (``SampleTotals``)."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

from pyengine.logprob_arrays import LOGPROB_FLOOR, LogprobBuffer
from pyengine.logprobs import Logprob
from pyengine.outputs import CompletionOutput, RequestMetrics, RequestOutput, with_logprob_arrays
from pyengine.sample_totals import SampleTotals


def _piece(token: int) -> str:
    return f"<{token}>"


def _buffer() -> LogprobBuffer:
    buffer = LogprobBuffer(2, _piece, capacity=1)
    # The sampled token 5 is second best; token 7 was excluded by top-k (-inf) and sampled anyway.
    assert buffer.append(5, -0.5, 2, np.array([1, 5, 9]), np.array([-0.25, -0.5, -1.0], np.float32)) == -0.5
    assert buffer.append(7, float("-inf"), 40, np.array([1, 5]), np.array([-0.25, -np.inf], np.float32)) \
        == LOGPROB_FLOOR
    return buffer


def test_a_position_is_its_own_token_first_then_the_top_k_without_it():
    assert _buffer().view().to_dicts() == [
        {5: Logprob(-0.5, 2, "<5>"), 1: Logprob(-0.25, 1, "<1>")},
        {7: Logprob(LOGPROB_FLOOR, 40, "<7>"), 1: Logprob(-0.25, 1, "<1>"), 5: Logprob(LOGPROB_FLOOR, 2, "<5>")},
    ]


def test_a_view_stays_as_it_was_while_the_buffer_grows():
    buffer = _buffer()
    first = buffer.view(0, 1)
    for _ in range(40):  # several doublings
        buffer.append(3, -2.0, 5, np.array([1, 5]), np.array([-0.25, -0.5], np.float32))
    assert first.to_dicts() == [{5: Logprob(-0.5, 2, "<5>"), 1: Logprob(-0.25, 1, "<1>")}]
    assert len(buffer.view()) == 42


def test_a_vocabulary_smaller_than_k_gives_all_of_it():
    buffer = LogprobBuffer(5, None)
    buffer.append(0, -0.125, 1, np.array([0, 1]), np.array([-0.125, -2.5], np.float32))
    assert buffer.view().to_dicts() == [{0: Logprob(-0.125, 1, None), 1: Logprob(-2.5, 2, None)}]


def test_maps_are_built_on_first_read_and_travel_with_a_copy():
    out = with_logprob_arrays(CompletionOutput(0, "ab", [5, 7]), _buffer().view())
    assert "logprobs" not in out.__dict__  # nothing built until read
    maps = out.logprobs
    assert isinstance(maps, list) and maps[0][5] == Logprob(-0.5, 2, "<5>")
    assert out.logprobs is maps  # kept
    again = pickle.loads(pickle.dumps(out))
    assert again == out and again.logprob_arrays is None and copy.deepcopy(out).logprobs == maps
    plain = CompletionOutput(0, "", [])
    assert plain.logprobs is None and plain.logprob_arrays is None


def test_prompt_logprobs_read_back_with_none_for_the_first_token():
    metrics = RequestMetrics(arrival_time=0.0)
    out = with_logprob_arrays(RequestOutput("r", None, [9, 5, 7], [], True, metrics), _buffer().view())
    assert out.prompt_logprobs[0] is None and out.prompt_logprobs[1][5].rank == 2
    empty = with_logprob_arrays(RequestOutput("r", None, [9], [], True, metrics), LogprobBuffer(0, None).view(0, 0))
    assert empty.prompt_logprobs == [None]


@pytest.mark.parametrize("kind", ["cumulative", "delta"])
def test_totals_hand_out_everything_or_what_is_new(kind):
    rows = _buffer().view()
    totals = SampleTotals(0)
    totals.add(with_logprob_arrays(CompletionOutput(0, "a", [5], -0.5), rows.__class__(
        rows.token_ids[:1], rows.logprobs[:1], rows.ranks[:1], rows.top_token_ids[:1], rows.top_logprobs[:1],
        rows.piece)))
    first = totals.output(kind)
    totals.add(with_logprob_arrays(CompletionOutput(0, "b", [7], -1.0, None, "length"),
                                   rows.__class__(rows.token_ids[1:], rows.logprobs[1:], rows.ranks[1:],
                                                  rows.top_token_ids[1:], rows.top_logprobs[1:], rows.piece)))
    second = totals.output(kind)
    assert (first.text, first.token_ids, len(first.logprobs)) == ("a", [5], 1)
    if kind == "cumulative":
        assert (second.text, second.token_ids, second.logprobs) == ("ab", [5, 7], rows.to_dicts())
        assert first.token_ids == [5]  # a fresh list each time
    else:
        assert (second.text, second.token_ids, second.logprobs) == ("b", [7], rows.to_dicts()[1:])
    assert (second.cumulative_logprob, second.finish_reason) == (-1.0, "length")
