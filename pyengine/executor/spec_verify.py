"""Verifying a step's drafts: the logits pipeline per entry, then the rejection sampler.

A plan with drafts (``num_draft_tokens`` not empty; docs/speculative_decoding.md) has one
logits row per *entry*: a sequence with ``d`` drafts has ``1 + d`` of them, the
distribution after its last committed token and after each draft. Each entry goes
through what an ordinary sample goes through, as of its own position:

1. logits processors: the built-in and custom processors' ``apply`` at the sequence's
   batch index, once for the first entries (with the usual state update) and again for
   each draft depth. A processor's state follows the committed tokens only, so a
   sequence whose processors depend on its output so far (``min_tokens``, ``bad_words``,
   any custom processor) refuses its drafts: it samples at its first entry, exactly;
2. grammar masks per entry (``mask_sample_indices`` index entries; the model runner);
3. penalties with the history as of the entry (the committed output plus the drafts
   before it);
4. temperature, top-k / top-p / min-p as the sampler does (``_RandomDraw``);
5. :func:`rejection_sampler.verify_drafts`: greedy sequences keep drafts that are the
   argmax; sampled ones by rejection sampling. Drafts here are point masses (n-gram,
   suffix, the draft model's argmax), for which rejection sampling is: draw a token at
   every entry as the sampler would (same variates: a seeded request's (seed, position)
   hash), keep drafts while they equal the draws, emit the draw at the first mismatch.
   So a seeded request emits exactly the tokens it emits without speculation, whatever
   its drafts and its batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from pyengine.executor.logits_pipeline import LogitsPipeline
from pyengine.executor.penalties import TokenHistory, apply_penalties
from pyengine.executor.rejection_sampler import DraftLayout, DraftPlanError, Verdict, verify_drafts
from pyengine.executor.runner_output import LogprobsOutput
from pyengine.executor.sampler import _RandomDraw, compute_logprobs
from pyengine.executor.sampling_table import SamplingTable
from pyengine.executor.seeded_noise import seeded_uniform
from pyengine.models.greedy import greedy_tokens

logger = logging.getLogger(__name__)

#: Called with (an entry of the step, the error) for a sequence whose own work failed.
OnEntryFailure = Callable[[int, BaseException], None]


def draft_layout(plan: Any) -> Optional[DraftLayout]:
    """The plan's drafts, or None when it has none (the ordinary path)."""
    counts = getattr(plan, "num_draft_tokens", None)
    if counts is None or len(counts) == 0:
        return None
    layout = DraftLayout.build(counts, plan.draft_token_ids, len(plan.logits_indices))
    rows = np.asarray(plan.sample_rows)
    if not np.array_equal(rows, np.repeat(rows[layout.starts], layout.counts + 1)):
        raise DraftPlanError("a sequence's entries do not share one sample row")
    return layout


@dataclass
class SpecVerification:
    """One verified step: the verdict and each entry's final logits (the distributions
    its tokens were drawn from, what their logprobs report)."""

    verdict: Verdict
    logprobs: Optional[LogprobsOutput]
    final_logits: torch.Tensor


def process_entries(
    pipeline: LogitsPipeline, logits: torch.Tensor, layout: DraftLayout, seq_rows: np.ndarray, greedy_only: bool,
    on_failure: OnEntryFailure,
) -> torch.Tensor:
    """The logits processors over every entry (step 1 of the module docstring); if one
    raises, every sequence of the step is reported, as ``row_isolation.process_isolated``."""
    starts_t = torch.from_numpy(layout.starts).to(logits.device)
    try:
        logits[starts_t] = pipeline.process(logits.index_select(0, starts_t), seq_rows, greedy_only)
        depths = int(layout.counts.max()) if pipeline.acts_on(seq_rows) else 0  # else: the identity
        for depth in range(1, depths + 1):
            having = np.flatnonzero(layout.counts >= depth)
            batch = logits.index_select(0, starts_t).clone()  # others: a filler row, discarded
            entries = torch.from_numpy(layout.starts[having] + depth).to(logits.device)
            having_t = torch.from_numpy(having).to(logits.device)
            batch[having_t] = logits.index_select(0, entries)
            logits[entries] = pipeline.apply_again(batch, greedy_only).index_select(0, having_t)
    except Exception as error:  # noqa: BLE001 - the step's requests get the error
        logger.warning("a logits processor failed (%r); failing the %d sequences of the step", error, len(seq_rows))
        for start in layout.starts.tolist():
            on_failure(int(start), error)
    return logits


class SpecVerifier:
    """Verifies drafts against the target's logits (module docstring, steps 3-5)."""

    def __init__(self, table: SamplingTable, generator: torch.Generator) -> None:
        self.table = table
        self.generator = generator

    def verify(
        self, logits: torch.Tensor, layout: DraftLayout, entry_rows: np.ndarray, next_positions: torch.Tensor,
        history: Optional[TokenHistory], no_drafts: Optional[np.ndarray] = None,
    ) -> SpecVerification:
        """``logits`` [E, vocab] after processors and grammar masks; ``entry_rows`` [E]
        each entry's batch row; ``next_positions`` [E] the position each entry samples."""
        table = self.table
        device = logits.device
        row_index = torch.from_numpy(entry_rows.astype(np.int64)).to(device)
        if history is not None and table.uses_penalties[entry_rows].any():
            logits = apply_penalties(
                logits, history.prompt_mask[row_index], self._counts_as_of_entries(history, layout, row_index),
                table.values["repetition_penalty"][row_index], table.values["presence_penalty"][row_index],
                table.values["frequency_penalty"][row_index],
            )
        seq_rows = entry_rows[layout.starts]
        greedy = table.greedy[seq_rows]
        final, entry_samples = logits, None
        if not greedy.all():  # each entry's draw, as the sampler makes it (point-mass drafts)
            sample_u = self._uniforms(entry_rows, row_index, next_positions)
            sampling = np.flatnonzero(~table.greedy[entry_rows])
            draw = _RandomDraw.prepare(logits, table, entry_rows, row_index, sampling)
            final = draw.processed_logits(logits)
            entry_samples = greedy_tokens(logits)
            entry_samples[draw.index] = draw.sample(sample_u[draw.index])
        verdict = verify_drafts(layout, final, greedy, entry_samples, no_drafts)
        return SpecVerification(verdict, None, final)

    def logprobs(self, verification: SpecVerification, entry_rows: np.ndarray) -> Optional[LogprobsOutput]:
        """Logprobs of each emitted token, from its entry's final distribution (None when
        no sequence of the step asked)."""
        verdict, final = verification.verdict, verification.final_logits
        wanted = self.table.logprobs[entry_rows[verdict.token_entries]]
        if not (wanted >= 0).any():
            return None
        tokens = torch.from_numpy(verdict.token_ids).to(final.device)
        index = torch.from_numpy(verdict.token_entries).to(final.device)
        return compute_logprobs(final.index_select(0, index), tokens, wanted)

    def verify_isolated(
        self, logits: torch.Tensor, layout: DraftLayout, entry_rows: np.ndarray, next_positions: torch.Tensor,
        history: Optional[TokenHistory], no_drafts: Optional[np.ndarray], on_failure: OnEntryFailure,
    ) -> SpecVerification:
        """``verify`` over the step; if it raises, each sequence alone, and a sequence that
        still raises keeps no draft and takes its first entry's argmax (discarded: its
        request is failed, ``on_failure`` with its first entry)."""
        try:
            return self.verify(logits, layout, entry_rows, next_positions, history, no_drafts)
        except Exception as batch_error:  # noqa: BLE001 - isolated below
            logger.warning("verifying the step's drafts failed (%r); verifying its %d sequences one by one",
                           batch_error, layout.num_seqs)
        parts: list[SpecVerification] = []
        for s in range(layout.num_seqs):
            start, d, first = int(layout.starts[s]), int(layout.counts[s]), int(layout.draft_starts[s])
            entries = slice(start, start + d + 1)
            one = DraftLayout.build(layout.counts[s:s + 1], layout.drafts[first:first + d], d + 1)
            try:
                refuse = None if no_drafts is None else no_drafts[s:s + 1]
                parts.append(self.verify(logits[entries], one, entry_rows[entries], next_positions[entries], history,
                                         refuse))
            except Exception as error:  # noqa: BLE001 - the sequence's request gets the error
                on_failure(start, error)
                token = greedy_tokens(logits[start:start + 1]).cpu().numpy().astype(np.int64)
                verdict = Verdict(np.zeros(1, dtype=np.int32), token, np.zeros(1, dtype=np.int64))
                parts.append(SpecVerification(verdict, None, logits[entries]))
        offsets = layout.starts
        verdict = Verdict(
            np.concatenate([p.verdict.num_accepted for p in parts]),
            np.concatenate([p.verdict.token_ids for p in parts]),
            np.concatenate([p.verdict.token_entries + offsets[s] for s, p in enumerate(parts)]),
        )
        return SpecVerification(verdict, None, torch.cat([p.final_logits for p in parts]))

    def _counts_as_of_entries(self, history: TokenHistory, layout: DraftLayout, row_index: torch.Tensor) -> torch.Tensor:
        """Output-token counts per entry: the row's committed output plus the drafts before
        the entry (draft ``j`` of a sequence counts for its entries ``j + 1 ..``)."""
        counts = history.output_counts.index_select(0, row_index).clone()
        entries, tokens = [], []
        for start, first, d in zip(layout.starts.tolist(), layout.draft_starts.tolist(), layout.counts.tolist()):
            for depth in range(1, d + 1):
                entries.extend([start + depth] * depth)
                tokens.extend(layout.drafts[first:first + depth].tolist())
        if entries:
            index = (torch.tensor(entries, device=counts.device), torch.tensor(tokens, device=counts.device))
            counts.index_put_(index, torch.ones(len(entries), dtype=counts.dtype, device=counts.device),
                              accumulate=True)
        return counts

    def _uniforms(self, entry_rows: np.ndarray, row_index: torch.Tensor, next_positions: torch.Tensor) -> torch.Tensor:
        """Per entry, the variate a token is drawn with there: seeded rows a hash of (seed,
        position), as without drafts; the others the engine's generator."""
        device = next_positions.device
        sample = torch.rand(len(entry_rows), generator=self.generator, device=device)
        seeded = np.flatnonzero(self.table.has_seed[entry_rows])
        if seeded.size:
            seeded_t = torch.from_numpy(seeded).to(device)
            sample[seeded_t] = seeded_uniform(self.table.seed[row_index[seeded_t]], next_positions[seeded_t])
        return sample
