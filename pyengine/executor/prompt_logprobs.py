"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``): which positions of a
step need logits beyond the sampled ones, and their log-probabilities.

The logits at prompt position ``j`` give the distribution of prompt token ``j + 1``. A
step that computes positions ``p0 .. p1 - 1`` of a sequence that asked therefore
contributes entries for prompt tokens ``p0 + 1 .. min(p1, L - 1)`` (``L`` the prompt
length); position ``L - 1`` is the sampled one (the first output token), never a prompt
entry. Chunked prefill spreads a prompt's entries over several steps (the output thread
puts them together by position); each chunk's last position needs the first token of the
next chunk, which is why the table keeps the asking rows' prompts.

Cost: nothing for a step none of whose rows asked (one host-side check). For a step that
has such rows, their positions' logits are computed after the sampled rows', in slices
of at most ``SLICE_POSITIONS`` positions (LM head, log-softmax, top-k, then the next
slice), so the step holds at most ``[SLICE_POSITIONS, vocab]`` float32 logits more
whatever its token budget, and the memory profile counts one slice. A failure in a slice
(out of memory) fails only the asking rows. Under tensor parallelism the plan the
workers receive carries the prompt positions and the slice size, and each slice is
one gather of the LM head's vocabulary slices.

A row stops being asked about once its last prompt position was computed, and a
sequence that comes back after a preemption (it holds output tokens, so every prompt
entry was delivered) is not asked about again.

The distribution is the model's own (raw logits, no penalties, temperature or top-k /
top-p), as vLLM reports prompt log-probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from pyengine.executor.plan import StepPlanLike
from pyengine.executor.runner_output import PromptLogprobsOutput

#: Prompt positions whose logits are computed at a time (bounds the step's memory: one
#: slice's [SLICE_POSITIONS, vocab] float32 logits and log-probabilities).
SLICE_POSITIONS = 1024


@dataclass
class PromptLogprobsJob:
    """What one step computes: per asking row with prompt positions in the step, its
    entries' token indices (into the step's ``T`` tokens) and their target prompt tokens."""

    step_id: int
    token_indices: np.ndarray  # int64 [P]
    targets: np.ndarray  # int64 [P]: the prompt token each entry's logits predict
    rows: np.ndarray  # int64 [R']: the persistent-batch row of each asking sequence
    first_positions: np.ndarray  # int64 [R']: prompt index of each row's first entry (>= 1)
    offsets: np.ndarray  # int64 [R' + 1]: each row's entries
    requested: np.ndarray  # int64 [R']: top-k asked by each row


class PromptPositionsPlan:
    """A plan with the job's prompt positions (``prompt_logits_indices``) and the size of
    their slices (``prompt_slice``): what tensor-parallel workers must compute logits for
    beyond the sampled ones; every other attribute is the plan's."""

    def __init__(self, plan: StepPlanLike, prompt_logits_indices: np.ndarray, prompt_slice: int) -> None:
        self._plan = plan
        self.prompt_logits_indices = prompt_logits_indices
        self.prompt_slice = prompt_slice

    def __getattr__(self, name: str) -> Any:
        return getattr(self._plan, name)


def prompt_slices(num_positions: int, size: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` bounds of the slices of ``num_positions`` prompt positions."""
    return [(lo, min(num_positions, lo + size)) for lo in range(0, num_positions, size)]


class PromptLogprobsTable:
    """Per persistent-batch row: how many top prompt logprobs its sequence asked for (-1:
    none) and, for the rows that asked, the prompt. Updated once per plan."""

    def __init__(self, max_rows: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.requested = np.full(max_rows, -1, dtype=np.int64)
        self.prompts: dict[int, np.ndarray] = {}
        self._job: Optional[PromptLogprobsJob] = None
        self._job_step: Optional[int] = None

    def job(self, plan: StepPlanLike) -> Optional[PromptLogprobsJob]:
        """The step's job (None when no scheduled row needs prompt logprobs). Idempotent per
        plan: tensor-parallel rank 0 asks before publishing the plan, then again inside
        the step."""
        if self._job_step == plan.step_id:
            return self._job
        self._update(plan)
        self._job_step, self._job = plan.step_id, self._plan_job(plan) if self.prompts else None
        return self._job

    def widen(self, plan: StepPlanLike) -> StepPlanLike:
        """``plan`` as tensor-parallel workers must run it (itself without a job)."""
        job = self.job(plan)
        return plan if job is None else PromptPositionsPlan(plan, job.token_indices, SLICE_POSITIONS)

    def _update(self, plan: StepPlanLike) -> None:
        if self.prompts and len(plan.freed_rows):
            for row in plan.freed_rows.tolist():
                self.requested[row] = -1
                self.prompts.pop(row, None)
        if not len(plan.new_rows):
            return
        for i, (row, params) in enumerate(zip(plan.new_rows.tolist(), plan.new_params)):
            k = getattr(params, "prompt_logprobs", None)  # PoolingParams have none
            start = int(plan.new_token_offsets[i])
            num_prompt = int(plan.new_num_prompt_tokens[i])
            # Outputs already (back after a preemption): every prompt entry was delivered.
            # A one-token prompt has none.
            resumed = int(plan.new_token_offsets[i + 1]) - start > num_prompt
            if k is None or resumed or num_prompt < 2:
                if self.requested[row] >= 0:
                    self.requested[row] = -1
                    self.prompts.pop(row, None)
                continue
            self.requested[row] = self.vocab_size if k == -1 else min(int(k), self.vocab_size)
            self.prompts[row] = np.asarray(plan.new_token_ids[start:start + num_prompt], dtype=np.int64).copy()

    def _plan_job(self, plan: StepPlanLike) -> Optional[PromptLogprobsJob]:
        asking = np.flatnonzero(self.requested[plan.rows] >= 0)
        if not asking.size:
            return None
        indices, targets, rows, firsts, counts, requested = [], [], [], [], [], []
        for i in asking.tolist():
            row = int(plan.rows[i])
            prompt = self.prompts[row]
            start = int(plan.query_start_loc[i])
            p0 = int(plan.positions[start])
            end = min(p0 + int(plan.num_scheduled_tokens[i]), len(prompt) - 1)  # exclusive
            if end <= p0:
                continue  # a decode step, or only the prompt's last position (the sampled one)
            indices.append(np.arange(start, start + end - p0, dtype=np.int64))
            targets.append(prompt[p0 + 1:end + 1])
            rows.append(row)
            firsts.append(p0 + 1)
            counts.append(end - p0)
            requested.append(int(self.requested[row]))
            if end == len(prompt) - 1:  # the last entry: the row has no more to compute
                self.requested[row] = -1
                del self.prompts[row]
        if not rows:
            return None
        return PromptLogprobsJob(
            step_id=plan.step_id,
            token_indices=np.concatenate(indices),
            targets=np.concatenate(targets),
            rows=np.array(rows, dtype=np.int64),
            first_positions=np.array(firsts, dtype=np.int64),
            offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            requested=np.array(requested, dtype=np.int64),
        )


def compute_prompt_logprobs(
    job: PromptLogprobsJob, slice_logits: Callable[[np.ndarray], torch.Tensor], seq_ids: np.ndarray
) -> PromptLogprobsOutput:
    """The job's log-probabilities, one slice of ``SLICE_POSITIONS`` positions at a time:
    ``slice_logits(token_indices)`` gives the float32 ``[n, vocab]`` logits of those step
    tokens; ``seq_ids`` is the batch's row -> sequence table."""
    k = int(job.requested.max())
    num = len(job.token_indices)
    chosen = np.empty(num, dtype=np.float32)
    ranks = np.empty(num, dtype=np.int64)
    top_ids = np.empty((num, k), dtype=np.int64)
    top_values = np.empty((num, k), dtype=np.float32)
    for lo, hi in prompt_slices(num, SLICE_POSITIONS):
        logits = slice_logits(job.token_indices[lo:hi])
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        del logits  # one slice's logits alive at a time
        targets = torch.from_numpy(job.targets[lo:hi]).to(logprobs.device)
        picked = logprobs.gather(1, targets.unsqueeze(1))
        chosen[lo:hi] = picked.squeeze(1).cpu().numpy()
        ranks[lo:hi] = ((logprobs > picked).sum(dim=-1) + 1).cpu().numpy()
        if k:
            top = logprobs.topk(k, dim=-1)
            top_ids[lo:hi] = top.indices.cpu().numpy()
            top_values[lo:hi] = top.values.cpu().numpy()
        del logprobs
    return PromptLogprobsOutput(
        seq_ids=seq_ids[job.rows].astype(np.int64),
        first_positions=job.first_positions,
        offsets=job.offsets,
        token_ids=job.targets,
        logprobs=chosen,
        ranks=ranks,
        top_token_ids=top_ids,
        top_logprobs=top_values,
        requested=job.requested,
    )
