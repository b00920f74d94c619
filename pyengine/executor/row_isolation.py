"""One request's bad row must not fail its step for everybody else.

Per-row work of a step (installing a new sequence's sampling parameters, sampling its
token) runs batched. When the batched call raises, it is redone row by row: the rows that
still raise are the guilty ones. Their sequences are reported as failed (with the error)
and their rows get inert greedy parameters, so the requests sharing the step go on
untouched and the next steps do not trip over the same row again. The batched path costs
nothing extra; the row-by-row path runs only after a failure.

A logits processor sees the whole batch, so when one raises, the step's rows are the
guilty ones; the processors are rebuilt before the next step. A step's grammar mask is
the same: when it cannot be taken or applied (a scheduler stall
past the mask timeout, a dropped mask), the constrained rows are the guilty ones (their
logits are unmasked, so their tokens must not count) and the other rows sample as usual.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import numpy as np
import torch

from pyengine.executor.grammar_mask import GrammarMaskApplier
from pyengine.executor.logits_pipeline import LogitsPipeline
from pyengine.executor.runner_output import LogprobsOutput
from pyengine.executor.sampler import Sampler, SamplerOutput
from pyengine.models.greedy import greedy_tokens
from pyengine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: What a poisoned row samples with until its request's abort reaches the scheduler.
INERT_PARAMS = SamplingParams(temperature=0.0)

#: Called with (position in the step's sampled rows, the error) for each guilty row.
OnRowFailure = Callable[[int, BaseException], None]


def sample_isolated(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: np.ndarray,
    next_positions: torch.Tensor,
    history: object,
    on_failure: OnRowFailure,
) -> SamplerOutput:
    """``sampler.sample`` over the step's rows; if it raises, each row alone, and a row that
    still raises gets its argmax token (discarded: its request is failed) and is reported."""
    try:
        return sampler.sample(logits, rows, next_positions, history)
    except Exception as batch_error:  # noqa: BLE001 - isolated below
        logger.warning("sampling the step failed (%r); sampling its %d rows one by one", batch_error, len(rows))
    tokens: list[torch.Tensor] = []
    logprobs: list[Optional[LogprobsOutput]] = []
    for i in range(len(rows)):
        try:
            out = sampler.sample(logits[i : i + 1], rows[i : i + 1], next_positions[i : i + 1], history)
        except Exception as error:  # noqa: BLE001 - the row's request gets the error
            on_failure(i, error)
            sampler.table.install(rows[i : i + 1], [INERT_PARAMS])
            out = SamplerOutput(greedy_tokens(logits[i : i + 1]), None)
        tokens.append(out.token_ids)
        logprobs.append(out.logprobs)
    return SamplerOutput(torch.cat(tokens), merge_logprobs(logprobs))


def process_isolated(
    pipeline: LogitsPipeline, logits: torch.Tensor, rows: np.ndarray, greedy_only: bool, on_failure: OnRowFailure
) -> torch.Tensor:
    """``pipeline.process`` over the step's logits; if a processor raises, every row of the
    step is reported (a processor sees the whole batch: which row it failed on is not
    known) and the pipeline rebuilds its processors before the next step, so the engine
    and later steps go on."""
    try:
        return pipeline.process(logits, rows, greedy_only)
    except Exception as error:  # noqa: BLE001 - the step's requests get the error
        logger.warning("a logits processor failed (%r); failing the %d rows of the step", error, len(rows))
        for i in range(len(rows)):
            on_failure(i, error)
        return logits


def mask_isolated(applier: GrammarMaskApplier, plan: Any, logits: torch.Tensor, on_failure: OnRowFailure) -> None:
    """``applier.apply(plan, logits)``; if it raises, every constrained sample (the plan's
    ``mask_sample_indices``, positions in the step's sampled rows) is reported instead."""
    try:
        applier.apply(plan, logits)
    except Exception as error:  # noqa: BLE001 - the constrained rows' requests get the error
        logger.warning("the grammar mask of step %s failed (%r); failing its %d constrained rows",
                       plan.step_id, error, len(plan.mask_sample_indices))
        for i in plan.mask_sample_indices.tolist():
            on_failure(int(i), error)


def merge_logprobs(parts: list[Optional[LogprobsOutput]]) -> Optional[LogprobsOutput]:
    """One row each, some None, into one output (rows without log-probabilities get
    ``requested = -1``; top lists padded to the widest)."""
    if all(p is None for p in parts):
        return None
    width = max(p.top_token_ids.shape[1] for p in parts if p is not None)
    n = len(parts)
    merged = LogprobsOutput(
        top_token_ids=np.zeros((n, width), dtype=np.int64),
        top_logprobs=np.zeros((n, width), dtype=np.float32),
        sampled_logprobs=np.zeros(n, dtype=np.float32),
        sampled_ranks=np.ones(n, dtype=np.int64),
        requested=np.full(n, -1, dtype=np.int64),
    )
    for i, p in enumerate(parts):
        if p is None:
            continue
        k = p.top_token_ids.shape[1]
        merged.top_token_ids[i, :k] = p.top_token_ids[0]
        merged.top_logprobs[i, :k] = p.top_logprobs[0]
        merged.sampled_logprobs[i] = p.sampled_logprobs[0]
        merged.sampled_ranks[i] = p.sampled_ranks[0]
        merged.requested[i] = p.requested[0]
    return merged
