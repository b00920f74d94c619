"""Rejection sampling of point-mass drafts keeps the target's distribution; greedy
verification keeps argmaxes.

The statistical tests draw many independent sequences in one seeded call (so they are
deterministic) and compare the emitted tokens' frequencies with the target's
probabilities by a chi-square statistic, against the 0.999 quantile of the chi-square
distribution (Wilson-Hilferty approximation).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pyengine.executor.rejection_sampler import DraftLayout, DraftPlanError, verify_drafts

VOCAB = 6
SAMPLES = 40_000


def chi_square_bound(df: int, z: float = 3.09) -> float:
    """The chi-square distribution's quantile at the normal quantile ``z`` (0.999)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi_square(tokens: np.ndarray, probs: np.ndarray) -> float:
    observed = np.bincount(tokens, minlength=len(probs)).astype(np.float64)
    expected = probs * len(tokens)
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def layout_of(counts: list[int], drafts: list[int]) -> DraftLayout:
    return DraftLayout.build(np.array(counts), np.array(drafts), len(counts) + len(drafts))


def target_logits(generator: torch.Generator, rows: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=generator) * 1.5


def repeat_rows(logits: torch.Tensor, times: int) -> torch.Tensor:
    return logits.unsqueeze(0).expand(times, *logits.shape).reshape(-1, VOCAB)


def test_masked_tokens_are_never_emitted():
    """A draft the target's final logits mask (-inf: top-k, grammar) is never kept, by a
    greedy sequence either (argmax elsewhere)."""
    gen = torch.Generator().manual_seed(3)
    per_seq = target_logits(gen, 2)
    per_seq[:, 4:] = float("-inf")
    n = 5000
    draws = torch.stack([torch.multinomial(per_seq.softmax(-1)[e], n, replacement=True, generator=gen)
                         for e in range(2)], 1).reshape(-1)
    greedy = np.arange(n) % 2 == 0
    verdict = verify_drafts(layout_of([1] * n, [5] * n), repeat_rows(per_seq, n), greedy, entry_samples=draws)
    assert (verdict.num_accepted == 0).all()  # the draft is masked: never kept
    assert (verdict.token_ids < 4).all()


def test_sampled_sequences_need_their_draws():
    with pytest.raises(ValueError, match="entry_samples"):
        verify_drafts(layout_of([1], [0]), torch.zeros(2, VOCAB), np.zeros(1, dtype=bool))


def test_greedy_keeps_drafts_while_they_are_the_argmax():
    logits = torch.full((7, VOCAB), -1.0)
    best = [2, 5, 1, 0, 3, 4, 4]
    logits[torch.arange(7), torch.tensor(best)] = 1.0
    # entries: seq 0 at 0-3 (argmaxes 2, 5, 1, 0), seq 1 at 4-5 (3, 4), seq 2 at 6 (4)
    # seq 0: drafts [2, 5, 0] -> keeps 2, 5, then the argmax 1; seq 1: [3] kept, bonus 4; seq 2: 4
    layout = layout_of([3, 1, 0], [2, 5, 0, 3])
    greedy = np.ones(3, dtype=bool)
    verdict = verify_drafts(layout, logits, greedy)
    assert verdict.num_accepted.tolist() == [2, 1, 0]
    assert verdict.token_ids.tolist() == [2, 5, 1, 3, 4, 4]
    assert verdict.token_entries.tolist() == [0, 1, 2, 4, 5, 6]
    other = layout_of([3, 1, 0], [2, 5, 1, 0])  # seq 0 all kept (bonus 0), seq 1's draft 0 is not 3
    all_right = verify_drafts(other, logits, greedy)
    assert all_right.num_accepted.tolist() == [3, 0, 0]
    assert all_right.token_ids.tolist() == [2, 5, 1, 0, 3, 4]
    refused = verify_drafts(other, logits, greedy, no_drafts=np.array([True, False, False]))
    assert refused.num_accepted.tolist() == [0, 0, 0]
    assert refused.token_ids.tolist() == [2, 3, 4]


def test_malformed_draft_arrays_are_refused():
    with pytest.raises(DraftPlanError, match="sums to"):
        DraftLayout.build(np.array([2]), np.array([1]), 3)
    with pytest.raises(DraftPlanError, match="logits entries"):
        DraftLayout.build(np.array([1, 1]), np.array([1, 2]), 3)


@pytest.mark.parametrize("draft_token", [0, 1, 3])
def test_point_mass_drafts_checked_against_draws_keep_the_target_distribution(draft_token):
    """Point-mass drafts (n-gram, suffix, a draft model's argmax) in the coupled form (a
    draw from p at every entry, drafts kept while equal): first and second tokens
    p-distributed, a draft kept with probability p(draft)."""
    gen = torch.Generator().manual_seed(21 + draft_token)
    per_seq = target_logits(gen, 2)
    probs = per_seq.softmax(-1).double().numpy()
    draws = torch.stack([torch.multinomial(per_seq.softmax(-1)[e], SAMPLES, replacement=True, generator=gen)
                         for e in range(2)], 1).reshape(-1)
    layout = layout_of([1] * SAMPLES, [draft_token] * SAMPLES)
    verdict = verify_drafts(layout, repeat_rows(per_seq, SAMPLES), np.zeros(SAMPLES, dtype=bool), entry_samples=draws)
    starts = np.concatenate([[0], np.cumsum(verdict.num_accepted.astype(np.int64) + 1)[:-1]])
    assert chi_square(verdict.token_ids[starts], probs[0]) < chi_square_bound(VOCAB - 1)
    kept = verdict.num_accepted == 1
    assert abs(kept.mean() - probs[0, draft_token]) < 4 * math.sqrt(probs[0, draft_token] / SAMPLES)
    assert chi_square(verdict.token_ids[starts[kept] + 1], probs[1]) < chi_square_bound(VOCAB - 1)
