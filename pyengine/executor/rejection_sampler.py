"""Accepting or rejecting drafts so that the tokens kept are distributed as the target's.

Speculative sampling (Leviathan et al., 2023; Chen et al., 2023): a draft ``x`` proposed
with probability ``q(x)`` is kept with probability ``min(1, p(x) / q(x))``, ``p`` the
target's final distribution at that position; at the first rejection the sequence takes
one token from the normalised residual ``max(0, p - q)`` and stops; when every draft is
kept it takes one more (the bonus) from ``p`` after the last draft. Each kept token is
then exactly ``p``-distributed.

Every proposer here makes point masses (n-gram, suffix, the draft model's argmax:
``q(x) = 1``), for which that rule has a coupled form, the one implemented: a token is
drawn from ``p`` at every entry exactly as the sampler would draw it (``entry_samples``),
drafts are kept while they equal the draws, and the draw at the first mismatch is the
extra token. A draft is then kept with probability ``p(x)`` and a mismatch is a draw from
``p`` without ``x``, the residual. A proposer with a distribution of its own (a draft
model sampling from ``q``) would need the general rule: it is not implemented.

Greedy sequences keep a draft exactly when it is the target's argmax (their "sample").

Everything is over one step's *entries* (a sequence with ``d`` drafts has ``1 + d``
consecutive ones: the distributions after its last committed token and after each
draft); the per-sequence bookkeeping is numpy on the host (S small), the vocabulary-wide
work tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from pyengine.errors import StepResultError
from pyengine.models.greedy import greedy_tokens


class DraftPlanError(StepResultError, ValueError):
    """A plan's draft arrays do not agree with its entries (a scheduler/executor mismatch)."""


@dataclass(frozen=True)
class DraftLayout:
    """Where each sequence's entries and drafts lie in a step.

    ``counts[s]`` drafts for sequence ``s`` (sample order); its entries are
    ``starts[s] .. starts[s] + counts[s]`` and its drafts ``draft_starts[s] ..``;
    ``draft_entries[t]`` is the entry whose distribution draft ``t`` is checked against
    (the one before it); ``entry_seq`` / ``entry_depth`` name each entry's sequence and
    its place among the sequence's entries.
    """

    counts: np.ndarray  # int64 [S]
    drafts: np.ndarray  # int64 [D]
    starts: np.ndarray  # int64 [S]
    draft_starts: np.ndarray  # int64 [S]
    draft_entries: np.ndarray  # int64 [D]
    entry_seq: np.ndarray  # int64 [E]
    entry_depth: np.ndarray  # int64 [E]

    @property
    def num_seqs(self) -> int:
        return len(self.counts)

    @classmethod
    def build(cls, num_draft_tokens: np.ndarray, draft_token_ids: np.ndarray, num_entries: int) -> "DraftLayout":
        counts = np.asarray(num_draft_tokens, dtype=np.int64)
        drafts = np.asarray(draft_token_ids, dtype=np.int64)
        if (counts < 0).any():
            raise DraftPlanError("num_draft_tokens has a negative count")
        if int(counts.sum()) != len(drafts):
            raise DraftPlanError(f"num_draft_tokens sums to {int(counts.sum())} but {len(drafts)} drafts are given")
        if len(counts) + len(drafts) != num_entries:
            raise DraftPlanError(f"{len(counts)} sequences with {len(drafts)} drafts need {len(counts) + len(drafts)} "
                                 f"logits entries, the plan has {num_entries}")
        sizes = counts + 1
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        draft_starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        entry_seq = np.repeat(np.arange(len(counts), dtype=np.int64), sizes)
        entry_depth = np.arange(num_entries, dtype=np.int64) - np.repeat(starts, sizes)
        draft_seq = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        draft_entries = starts[draft_seq] + (np.arange(len(drafts), dtype=np.int64) - draft_starts[draft_seq])
        return cls(counts, drafts, starts, draft_starts, draft_entries, entry_seq, entry_depth)


@dataclass
class Verdict:
    """What verification kept: ``num_accepted[s]`` drafts of sequence ``s``, then one more
    token; ``token_ids`` flat (per sequence: its kept drafts, then that token) and
    ``token_entries`` the entry each token was drawn at (for its logprobs)."""

    num_accepted: np.ndarray  # int32 [S]
    token_ids: np.ndarray  # int64 [S + sum(num_accepted)]
    token_entries: np.ndarray  # int64 [same]


def verify_drafts(
    layout: DraftLayout,
    final_logits: torch.Tensor,
    greedy: np.ndarray,
    entry_samples: Optional[torch.Tensor] = None,
    no_drafts: Optional[np.ndarray] = None,
) -> Verdict:
    """The verdict for one step.

    - ``final_logits`` [E, vocab]: each entry's final logits (processed, tempered and
      top-k/top-p/min-p masked for sampled sequences; ``-inf`` = never drawn).
    - ``greedy`` [S]: the sequence decodes greedily (argmax match, no randomness).
    - ``entry_samples`` [E]: a token drawn from ``p`` at every entry (needed when a
      sequence samples). A sampled sequence keeps a draft exactly when it equals the
      entry's draw, and takes the draw at its first mismatch (or the bonus entry): the
      rejection rule for a point mass (module docstring); with the draws a sequence makes
      without drafts (its seed's variate at each position), it emits the very tokens it
      would emit without speculation.
    - ``no_drafts`` [S] bool: sequences whose drafts must all be refused (their
      processors' state cannot be advanced by drafts); they sample at their first entry.
    """
    S = layout.num_seqs
    device = final_logits.device
    sampled_seqs = np.flatnonzero(~greedy)
    if sampled_seqs.size and entry_samples is None:
        raise ValueError("sampled sequences need entry_samples, a draw from p at every entry")
    drafts_t = torch.from_numpy(layout.drafts).to(device)
    check_index = torch.from_numpy(layout.draft_entries).to(device)
    draft_seq = np.repeat(np.arange(S, dtype=np.int64), layout.counts)
    accepted = np.zeros(len(layout.drafts), dtype=bool)
    if len(layout.drafts):
        checked = final_logits.index_select(0, check_index)
        accepted = (greedy_tokens(checked) == drafts_t).cpu().numpy()
        sampled_drafts = ~greedy[draft_seq]
        if sampled_drafts.any():
            draws = entry_samples.index_select(0, check_index)  # type: ignore[union-attr]
            accepted = np.where(sampled_drafts, (draws == drafts_t).cpu().numpy(), accepted)
        if no_drafts is not None and no_drafts.any():
            accepted &= ~no_drafts[draft_seq]
    num_accepted = _leading_accepts(accepted, layout)
    extra_entries = layout.starts + num_accepted
    extra = greedy_tokens(final_logits.index_select(0, torch.from_numpy(extra_entries).to(device)))
    if sampled_seqs.size:
        at = torch.from_numpy(extra_entries[sampled_seqs]).to(device)
        extra[torch.from_numpy(sampled_seqs).to(device)] = entry_samples.index_select(0, at)  # type: ignore[union-attr]
    extra = extra.cpu().numpy().astype(np.int64)
    # Flat output: per sequence, its kept drafts then its extra token.
    lengths = num_accepted + 1
    out_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    total = int(lengths.sum())
    token_ids = np.empty(total, dtype=np.int64)
    token_entries = np.empty(total, dtype=np.int64)
    within = np.arange(total, dtype=np.int64) - np.repeat(out_starts, lengths)
    owner = np.repeat(np.arange(S, dtype=np.int64), lengths)
    is_extra = within == num_accepted[owner]
    kept = ~is_extra
    token_ids[kept] = layout.drafts[layout.draft_starts[owner[kept]] + within[kept]]
    token_ids[is_extra] = extra
    token_entries[:] = layout.starts[owner] + within
    return Verdict(num_accepted.astype(np.int32), token_ids, token_entries)


def _leading_accepts(accepted: np.ndarray, layout: DraftLayout) -> np.ndarray:
    """Per sequence, how many of its drafts are kept: those before its first rejection."""
    counts = layout.counts
    if not len(accepted):
        return np.zeros(len(counts), dtype=np.int64)
    # cumulative "all kept so far" within each sequence, via a running count of rejections
    rejections = np.cumsum(~accepted)
    before = np.concatenate([[0], rejections])[layout.draft_starts]  # rejections before each sequence's first
    clean = rejections == np.repeat(before, counts)
    draft_seq = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    return np.bincount(draft_seq[clean], minlength=len(counts)).astype(np.int64)
