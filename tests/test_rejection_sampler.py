"""Rejection sampling keeps the target's distribution; greedy verification keeps argmaxes.

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


@pytest.mark.parametrize("draft_token", [0, 3])
def test_point_mass_drafts_keep_the_target_distribution(draft_token):
    """n-gram drafts (q a point mass): the first token is distributed as p at entry 0 and,
    when the draft was kept, the second as p at entry 1."""
    gen = torch.Generator().manual_seed(1 + draft_token)
    per_seq = target_logits(gen, 2)  # entry 0 (checks the draft), entry 1 (bonus)
    probs = per_seq.softmax(-1).double().numpy()
    layout = layout_of([1] * SAMPLES, [draft_token] * SAMPLES)
    verdict = verify_drafts(
        layout, repeat_rows(per_seq, SAMPLES), np.zeros(SAMPLES, dtype=bool),
        torch.rand(SAMPLES, generator=gen), torch.rand(2 * SAMPLES, generator=gen),
    )
    starts = np.concatenate([[0], np.cumsum(verdict.num_accepted.astype(np.int64) + 1)[:-1]])
    first = verdict.token_ids[starts]
    assert chi_square(first, probs[0]) < chi_square_bound(VOCAB - 1)
    kept = verdict.num_accepted == 1
    assert abs(kept.mean() - probs[0, draft_token]) < 4 * math.sqrt(probs[0, draft_token] / SAMPLES)
    second = verdict.token_ids[starts[kept] + 1]
    assert chi_square(second, probs[1]) < chi_square_bound(VOCAB - 1)
    assert (verdict.token_entries[starts[kept] + 1] == layout.starts[kept] + 1).all()


def test_draft_model_probabilities_keep_the_target_distribution():
    """A draft model's drafts: x ~ q, kept with min(1, p/q), else the residual max(0, p - q)."""
    gen = torch.Generator().manual_seed(7)
    per_seq = target_logits(gen, 3)
    q = (torch.randn(2, VOCAB, generator=gen) * 1.5).softmax(-1)
    q[0, 2] = 0.0  # a token the draft never proposes: the target still emits it
    q = q / q.sum(-1, keepdim=True)
    first_draft = torch.multinomial(q[0], SAMPLES, replacement=True, generator=gen)
    second_draft = torch.multinomial(q[1], SAMPLES, replacement=True, generator=gen)
    drafts = torch.stack([first_draft, second_draft], 1).reshape(-1).numpy()
    layout = layout_of([2] * SAMPLES, drafts.tolist())
    verdict = verify_drafts(
        layout, repeat_rows(per_seq, SAMPLES), np.zeros(SAMPLES, dtype=bool),
        torch.rand(2 * SAMPLES, generator=gen), torch.rand(3 * SAMPLES, generator=gen),
        draft_probs=repeat_rows(q, SAMPLES).float(),
    )
    probs = per_seq.softmax(-1).double().numpy()
    starts = np.concatenate([[0], np.cumsum(verdict.num_accepted.astype(np.int64) + 1)[:-1]])
    assert chi_square(verdict.token_ids[starts], probs[0]) < chi_square_bound(VOCAB - 1)
    # Entry 1's distribution does not depend on the first token here, so every second token is p[1]-distributed.
    has_second = verdict.num_accepted >= 1
    assert chi_square(verdict.token_ids[starts[has_second] + 1], probs[1]) < chi_square_bound(VOCAB - 1)


def test_masked_tokens_are_never_emitted():
    """-inf logits (top-k, grammar) are never drawn, neither as a correction nor a bonus."""
    gen = torch.Generator().manual_seed(3)
    per_seq = target_logits(gen, 2)
    per_seq[:, 4:] = float("-inf")
    n = 5000
    verdict = verify_drafts(
        layout_of([1] * n, [5] * n), repeat_rows(per_seq, n), np.zeros(n, dtype=bool),
        torch.rand(n, generator=gen), torch.rand(2 * n, generator=gen),
    )
    assert (verdict.num_accepted == 0).all()  # the draft is masked: never kept
    assert (verdict.token_ids < 4).all()


def test_greedy_keeps_drafts_while_they_are_the_argmax():
    logits = torch.full((7, VOCAB), -1.0)
    best = [2, 5, 1, 0, 3, 4, 4]
    logits[torch.arange(7), torch.tensor(best)] = 1.0
    # entries: seq 0 at 0-3 (argmaxes 2, 5, 1, 0), seq 1 at 4-5 (3, 4), seq 2 at 6 (4)
    # seq 0: drafts [2, 5, 0] -> keeps 2, 5, then the argmax 1; seq 1: [3] kept, bonus 4; seq 2: 4
    layout = layout_of([3, 1, 0], [2, 5, 0, 3])
    greedy = np.ones(3, dtype=bool)
    verdict = verify_drafts(layout, logits, greedy, torch.rand(4), torch.rand(7))
    assert verdict.num_accepted.tolist() == [2, 1, 0]
    assert verdict.token_ids.tolist() == [2, 5, 1, 3, 4, 4]
    assert verdict.token_entries.tolist() == [0, 1, 2, 4, 5, 6]
    other = layout_of([3, 1, 0], [2, 5, 1, 0])  # seq 0 all kept (bonus 0), seq 1's draft 0 is not 3
    all_right = verify_drafts(other, logits, greedy, torch.rand(4), torch.rand(7))
    assert all_right.num_accepted.tolist() == [3, 0, 0]
    assert all_right.token_ids.tolist() == [2, 5, 1, 0, 3, 4]
    refused = verify_drafts(other, logits, greedy, torch.rand(4), torch.rand(7), no_drafts=np.array([True, False, False]))
    assert refused.num_accepted.tolist() == [0, 0, 0]
    assert refused.token_ids.tolist() == [2, 3, 4]


def test_malformed_draft_arrays_are_refused():
    with pytest.raises(DraftPlanError, match="sums to"):
        DraftLayout.build(np.array([2]), np.array([1]), 3)
    with pytest.raises(DraftPlanError, match="logits entries"):
        DraftLayout.build(np.array([1, 1]), np.array([1, 2]), 3)


def test_point_mass_drafts_checked_against_draws_keep_the_target_distribution():
    """The coupled form (a draw from p at every entry, drafts kept while equal): first and
    second tokens p-distributed, a draft kept with probability p(draft)."""
    gen = torch.Generator().manual_seed(21)
    per_seq = target_logits(gen, 2)
    probs = per_seq.softmax(-1).double().numpy()
    draws = torch.stack([torch.multinomial(per_seq.softmax(-1)[e], SAMPLES, replacement=True, generator=gen)
                         for e in range(2)], 1).reshape(-1)
    layout = layout_of([1] * SAMPLES, [1] * SAMPLES)
    verdict = verify_drafts(layout, repeat_rows(per_seq, SAMPLES), np.zeros(SAMPLES, dtype=bool),
                            torch.rand(SAMPLES, generator=gen), torch.rand(2 * SAMPLES, generator=gen),
                            entry_samples=draws)
    starts = np.concatenate([[0], np.cumsum(verdict.num_accepted.astype(np.int64) + 1)[:-1]])
    assert chi_square(verdict.token_ids[starts], probs[0]) < chi_square_bound(VOCAB - 1)
    kept = verdict.num_accepted == 1
    assert abs(kept.mean() - probs[0, 1]) < 4 * math.sqrt(probs[0, 1] / SAMPLES)
    assert chi_square(verdict.token_ids[starts[kept] + 1], probs[1]) < chi_square_bound(VOCAB - 1)
