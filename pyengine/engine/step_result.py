"""``StepResult``: everything one executed step produced beyond the sampled ids.

The executor hands it to the scheduler with the sampled ids (``submit_result`` /
``fail_step``); the scheduler moves it, unread, into that step's ``OutputEvent``
(``event.step_result``), where the output thread takes it. So the data crosses the
channels with the step it belongs to, and no table is shared between the threads. Plain
data only (numpy arrays, strings, numbers): the same object can later cross a process
boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from pyengine.executor.runner_output import LogprobsOutput, PromptLogprobsOutput


@dataclass(frozen=True)
class StepResult:
    step_id: int
    #: Wall-clock time the step began: the first-scheduled time of its new sequences.
    started_at: float
    #: [K] sequences (re)admitted by this step's plan.
    new_seq_ids: np.ndarray
    #: [S] the sequence of each sampled entry, with ``logprobs`` (None when no row asked).
    sampled_seq_ids: Optional[np.ndarray] = None
    logprobs: Optional[LogprobsOutput] = None
    #: [P] pooling sequences whose prompt ended here, and their vectors (float32 [P, H]).
    pooled_seq_ids: Optional[np.ndarray] = None
    pooled: Optional[np.ndarray] = None
    #: Why the step failed (``fail_step``), None when it ran.
    error: Optional[str] = None
    #: Sequences whose own per-row work failed in a step that otherwise ran, with the
    #: error: only their requests fail.
    row_errors: Optional[dict[int, str]] = None
    #: Prompt log-probabilities computed in this step (requests with prompt_logprobs).
    prompt_logprobs: Optional[PromptLogprobsOutput] = None

    def logprob_rows(self) -> Optional[dict[int, int]]:
        """Sequence id -> row of ``logprobs``, or None without log-probabilities."""
        if self.logprobs is None or self.sampled_seq_ids is None:
            return None
        return {s: i for i, s in enumerate(self.sampled_seq_ids.tolist())}

    def embeddings(self) -> dict[int, list[float]]:
        """Sequence id -> pooled vector."""
        if self.pooled is None or self.pooled_seq_ids is None:
            return {}
        return dict(zip(self.pooled_seq_ids.tolist(), self.pooled.tolist()))
