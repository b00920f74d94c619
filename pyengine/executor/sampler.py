"""Batched sampling: penalties, temperature, top-k / top-p / min-p, seeds, logprobs.

Everything is a tensor operation over the ``S`` rows sampled in the step; the host-side
flags of :class:`SamplingTable` skip the stages no row of the step uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from pyengine.executor.penalties import TokenHistory, apply_penalties
from pyengine.executor.runner_output import LogprobsOutput
from pyengine.executor.sampling_table import SamplingTable
from pyengine.executor.seeded_noise import seeded_uniform
from pyengine.models.greedy import greedy_tokens


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # int64 [S], on the device
    logprobs: Optional[LogprobsOutput]


class Sampler:
    """Turns logits of the sampled rows into tokens (and logprobs when asked)."""

    def __init__(self, table: SamplingTable, generator: torch.Generator) -> None:
        self.table = table
        self.generator = generator

    def sample(
        self,
        logits: torch.Tensor,
        rows: np.ndarray,
        next_positions: torch.Tensor,
        history: Optional[TokenHistory],
    ) -> SamplerOutput:
        """``logits`` float32 [S, vocab]; ``rows`` [S] host rows; ``next_positions`` [S] device
        positions of the tokens being sampled (seeded draws key on them)."""
        table = self.table
        row_index = torch.from_numpy(rows.astype(np.int64)).to(logits.device)
        if history is not None and table.uses_penalties[rows].any():
            logits = apply_penalties(
                logits,
                history.prompt_mask[row_index],
                history.output_counts[row_index],
                table.values["repetition_penalty"][row_index],
                table.values["presence_penalty"][row_index],
                table.values["frequency_penalty"][row_index],
            )
        greedy = table.greedy[rows]
        draw = None
        if greedy.all():
            token_ids = greedy_tokens(logits)
        else:
            uniform = _draw_uniform(self.generator, table, rows, row_index, next_positions)
            draw = _RandomDraw.prepare(logits, table, rows, row_index, np.flatnonzero(~greedy))
            token_ids = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
            token_ids[draw.index] = draw.sample(uniform[draw.index])
            if greedy.any():
                greedy_index = torch.from_numpy(np.flatnonzero(greedy)).to(logits.device)
                token_ids[greedy_index] = greedy_tokens(logits[greedy_index])
        wanted = table.logprobs[rows]
        if not (wanted >= 0).any():
            return SamplerOutput(token_ids, None)
        final = logits if draw is None else draw.processed_logits(logits)
        return SamplerOutput(token_ids, compute_logprobs(final, token_ids, wanted))


@dataclass
class _RandomDraw:
    """The rows of a step that sample (not greedy): their tempered logits and the smallest
    logit each keeps after top-k, top-p and min-p (``threshold`` [n, 1]); with top-k or
    top-p, also each row's best candidate tokens (``best`` values, ``best_ids``)."""

    index: torch.Tensor  # positions of these rows in the step's logits
    scaled: torch.Tensor
    threshold: torch.Tensor
    filtered: bool  # some row has top-k, top-p or min-p (else every threshold is -inf)
    best: Optional[torch.Tensor]
    best_ids: Optional[torch.Tensor]

    @classmethod
    def prepare(
        cls, logits: torch.Tensor, table: SamplingTable, rows: np.ndarray, row_index: torch.Tensor,
        sampling: np.ndarray,
    ) -> "_RandomDraw":
        index = torch.from_numpy(sampling).to(logits.device)
        if len(sampling) < len(rows):  # (a gather of the whole batch would copy it for nothing)
            logits, rows, row_index = logits[index], rows[sampling], row_index[index]
        scaled = logits / table.values["temperature"][row_index].unsqueeze(1)
        threshold = scaled.new_full((len(sampling), 1), float("-inf"))
        best = best_ids = None
        top_k_top_p, min_p = bool(table.uses_top_k_top_p[rows].any()), bool(table.uses_min_p[rows].any())
        if top_k_top_p:
            threshold, best, best_ids = top_k_top_p_thresholds(
                scaled, table.top_k[row_index], table.values["top_p"][row_index]
            )
        if min_p:  # p < min_p * p_max  <=>  logit < max + log(min_p)
            row_max = best[:, :1] if best is not None else scaled.max(dim=-1, keepdim=True).values
            threshold = torch.maximum(threshold, row_max + table.values["min_p"][row_index].log().unsqueeze(1))
        return cls(index, scaled, threshold, top_k_top_p or min_p, best, best_ids)

    def sample(self, uniform: torch.Tensor) -> torch.Tensor:
        """A token per row, by inverse transform with the row's ``uniform`` variate: among
        the best candidates when everything the row keeps is one, else over the vocabulary."""
        if self.best is None:
            inside = torch.zeros(len(uniform), dtype=torch.bool, device=uniform.device)
        elif self.best.shape[1] == self.scaled.shape[-1]:  # the candidates are the vocabulary
            inside = torch.ones(len(uniform), dtype=torch.bool, device=uniform.device)
        else:
            inside = (self.threshold > self.best[:, -1:]).squeeze(1)
        sampled = torch.empty(len(uniform), dtype=torch.int64, device=uniform.device)
        small, large = inside.nonzero().squeeze(1), (~inside).nonzero().squeeze(1)
        if small.numel():
            assert self.best is not None and self.best_ids is not None
            best = self.best[small]
            probs = best.masked_fill(best < self.threshold[small], float("-inf")).softmax(dim=-1)
            chosen = _inverse_transform(probs, uniform[small]).unsqueeze(1)
            sampled[small] = self.best_ids[small].gather(1, chosen).squeeze(1)
        if large.numel():
            scaled = self.scaled if len(large) == len(uniform) else self.scaled[large]
            if self.filtered:
                scaled = scaled.masked_fill(scaled < self.threshold[large], float("-inf"))
            sampled[large] = _inverse_transform(scaled.softmax(dim=-1), uniform[large])
        return sampled

    def processed_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's final logits, as logprobs report them: tempered and masked for these
        rows, unchanged for greedy ones (built only when logprobs are asked for)."""
        out = logits.clone()
        out[self.index] = self.scaled.masked_fill(self.scaled < self.threshold, float("-inf"))
        return out


def _inverse_transform(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds ``uniform`` times the
    total (tokens of probability 0 are never drawn). The sum is float64: in float32, once
    it nears 1, probabilities under 3e-8 would vanish and slightly larger ones round up."""
    cumulative = probs.cumsum(dim=-1, dtype=torch.float64)
    target = (uniform.double() * cumulative[:, -1]).unsqueeze(1)
    return torch.searchsorted(cumulative, target, right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)


def _draw_uniform(
    generator: torch.Generator, table: SamplingTable, rows: np.ndarray, row_index: torch.Tensor,
    next_positions: torch.Tensor,
) -> torch.Tensor:
    """One uniform variate per sampled row: from the engine's generator, or for seeded rows
    from their (seed, position), whatever the rest of the batch."""
    device = next_positions.device
    uniform = torch.rand(len(rows), generator=generator, device=device)
    seeded = np.flatnonzero(table.has_seed[rows])
    if seeded.size:
        seeded_index = torch.from_numpy(seeded).to(device)
        uniform[seeded_index] = seeded_uniform(table.seed[row_index[seeded_index]], next_positions[seeded_index])
    return uniform


# How many of each row's best tokens the top-k / top-p masks are looked for among before
# a row's whole vocabulary is sorted.
TOP_P_CANDIDATES = 1024


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and nucleus (top_k 0 = off, top_p 1 = off);
    see :func:`top_k_top_p_thresholds`."""
    threshold, _, _ = top_k_top_p_thresholds(logits, top_k, top_p)
    return logits.masked_fill(logits < threshold, float("-inf"))


def top_k_top_p_thresholds(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The smallest logit each row keeps under its top-k and top-p ([rows, 1]), and the
    row's best candidates: values (descending) and token ids, ``[rows, TOP_P_CANDIDATES]``.

    The nucleus is the smallest set of the most likely tokens top-k keeps whose probability
    reaches top_p; tokens tied with its least likely one stay in. Both masks are looked
    for among each row's ``TOP_P_CANDIDATES`` best tokens (one partial selection); only
    rows whose answer lies further down are sorted whole. Sorting a 152k vocabulary takes
    ~8 ms a row on a CPU core, the selection a small part of that.
    """
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    candidates = min(vocab, TOP_P_CANDIDATES)
    best, best_ids = logits.topk(candidates, dim=-1)  # descending
    no_top_k = (k >= vocab).unsqueeze(1)
    kth = torch.where(no_top_k, float("-inf"), best.gather(1, (k.clamp(max=candidates) - 1).unsqueeze(1)))
    in_k = best >= kth  # a prefix of the candidates
    log_total = best.masked_fill(~in_k, float("-inf")).logsumexp(-1, keepdim=True)
    if bool(no_top_k.any()):  # top-k keeps the whole row: normalise over all of it
        log_total = torch.where(no_top_k, logits.logsumexp(-1, keepdim=True), log_total)
    probs = (best - log_total).exp().masked_fill(~in_k, 0.0)
    above = probs.cumsum(-1) - probs  # the mass of the better candidates
    nucleus = ((above < top_p.unsqueeze(1)) & in_k).sum(-1, keepdim=True)  # a prefix too
    no_top_p = (top_p >= 1.0).unsqueeze(1)
    threshold = torch.where(no_top_p, kth, best.gather(1, (nucleus - 1).clamp(min=0)))
    if candidates < vocab:
        # Exact where no token beyond the candidates ties the k-th best, and the nucleus
        # (if any) ends before the last candidate or top-k ends it sooner.
        k_exact = no_top_k | (best[:, -1:] < kth)
        p_exact = no_top_p | ~no_top_k | (nucleus < candidates)
        slow = (~(k_exact & p_exact)).squeeze(1).nonzero().squeeze(1)
        if slow.numel():
            threshold[slow] = _thresholds_by_sorting(logits[slow], k[slow], top_p[slow])
    return threshold, best, best_ids


def _thresholds_by_sorting(logits: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The smallest logit each row keeps, from whole sorted rows."""
    ordered = logits.sort(dim=-1, descending=True).values
    kth = ordered.gather(1, (k - 1).unsqueeze(1))
    probs = ordered.masked_fill(ordered < kth, float("-inf")).softmax(dim=-1)
    above = probs.cumsum(-1) - probs
    nucleus = ((above < top_p.unsqueeze(1)) & (ordered >= kth)).sum(-1, keepdim=True)
    return ordered.gather(1, (nucleus - 1).clamp(min=0))


def compute_logprobs(processed: torch.Tensor, token_ids: torch.Tensor, wanted: np.ndarray) -> LogprobsOutput:
    """Top-k logprobs of the final distribution, plus the sampled token's logprob and rank."""
    logprobs = torch.log_softmax(processed, dim=-1)
    k = min(int(wanted.max()), processed.shape[-1])
    top_logprobs, top_ids = (
        logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], token_ids[:, None][:, :0])
    )
    sampled = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > sampled.unsqueeze(1)).sum(dim=-1) + 1
    return LogprobsOutput(
        top_token_ids=top_ids.cpu().numpy().astype(np.int64),
        top_logprobs=top_logprobs.float().cpu().numpy(),
        sampled_logprobs=sampled.float().cpu().numpy(),
        sampled_ranks=ranks.cpu().numpy().astype(np.int64),
        requested=wanted.copy(),
    )
