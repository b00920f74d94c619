"""What the model runner returns for one executed step (``ModelRunnerOutput``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


@dataclass
class LogprobsOutput:
    """Log-probabilities of the final (processed) distribution, one row per sampled entry.

    ``top_token_ids`` / ``top_logprobs`` are ``[S, k]`` with k the largest ``logprobs``
    requested in the step (rows that asked for fewer use a prefix); ``sampled_logprobs``
    and ``sampled_ranks`` (1 = most likely) describe the sampled token itself.
    """

    top_token_ids: np.ndarray  # int64 [S, k]
    top_logprobs: np.ndarray  # float32 [S, k]
    sampled_logprobs: np.ndarray  # float32 [S]
    sampled_ranks: np.ndarray  # int64 [S]
    requested: np.ndarray  # int64 [S]: logprobs asked by each row (-1 = none)


@dataclass
class PromptLogprobsOutput:
    """Prompt log-probabilities computed in one step (``executor/prompt_logprobs.py``),
    for the sequences that asked and had prompt positions in the step.

    Sequence ``seq_ids[r]`` has entries ``offsets[r] .. offsets[r + 1] - 1``, for prompt
    tokens ``first_positions[r]``, ``first_positions[r] + 1``, ...: the prompt token's id,
    log-probability and rank (1 = most likely), and the top ``requested[r]`` of the
    position's distribution (a prefix of the ``[P, k]`` arrays, k the step's largest).
    """

    seq_ids: np.ndarray  # int64 [R]
    first_positions: np.ndarray  # int64 [R]
    offsets: np.ndarray  # int64 [R + 1]
    token_ids: np.ndarray  # int64 [P]
    logprobs: np.ndarray  # float32 [P]
    ranks: np.ndarray  # int64 [P]
    top_token_ids: np.ndarray  # int64 [P, k]
    top_logprobs: np.ndarray  # float32 [P, k]
    requested: np.ndarray  # int64 [R]


@dataclass
class ModelRunnerOutput:
    """Result of :meth:`ModelRunner.execute` for one plan.

    ``sampled_token_ids`` is aligned with the plan's ``logits_indices`` (what
    ``submit_result`` wants), and ``sampled_seq_ids`` names their sequences; ``pooled``
    is aligned with ``pool_indices``, and ``pooled_seq_ids`` names those. ``logits`` (raw float32 logits
    of ``logits_indices``) and ``hidden_states`` (final-normed, every token) are only
    filled when asked for (tests, debugging).
    """

    step_id: int
    sampled_token_ids: np.ndarray  # int64 [S]
    sampled_seq_ids: Optional[np.ndarray] = None  # int64 [S]
    logprobs: Optional[LogprobsOutput] = None
    pooled: Optional[torch.Tensor] = None  # float32 [P, hidden]
    pooled_seq_ids: Optional[np.ndarray] = None  # int64 [P]
    #: Sequences whose own per-row work failed in this step (their tokens are meaningless),
    #: with the error; the rest of the step is good.
    row_errors: Optional[dict[int, str]] = None
    prompt_logprobs: Optional[PromptLogprobsOutput] = None
    #: A plan with drafts (docs/speculative_decoding.md): per sampled sequence, how many of
    #: its drafts were kept; ``sampled_token_ids`` then holds, per sequence, its kept
    #: drafts and one more token ([S + sum], ``submit_result``'s ``sampled``), and
    #: ``logprobs`` / ``sampled_seq_ids`` one row per element of it. None: no drafts.
    num_accepted: Optional[np.ndarray] = None  # int32 [S]
    #: Drafts proposed by the executor for each sampled sequence's next step (a draft
    #: model): (counts int32 [S], tokens int64 [sum]); None otherwise.
    next_drafts: Optional[tuple[np.ndarray, np.ndarray]] = None
    logits: Optional[torch.Tensor] = None
    hidden_states: Optional[torch.Tensor] = None
