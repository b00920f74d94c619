"""The step plan to ranks that may be on other hosts: two gloo broadcasts per step.

Shared memory only reaches the ranks on rank 0's host. With ranks launched from outside
(torchrun, ``distributed_executor_backend="external_launcher"``) rank 0 broadcasts each
plan over a gloo group of its own: a 13-element header (sequence, step id, the array
lengths, the kind: step or exit, the prompt positions' slice size, the draft lengths, the
per-group tables' lengths), then the arrays concatenated into one int64 buffer,
laid out as in the shared segment (``plan_channel.ARRAYS``). The group is created with a
long timeout: a worker waits in the header broadcast while the engine is idle, and a
rank 0 that dies closes its connections, which ends that wait at once.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import numpy as np
import torch

from pyengine.executor.tensor_parallel.plan_channel import (
    ARRAYS,
    ForwardPlan,
    draft_counts,
    draft_ids,
    group_slots,
    plan_lengths,
    prompt_positions,
    table_groups,
)
from pyengine.models.parallel import CollectiveError

STEP, EXIT = 1, 2
_HEADER_LENGTH = 13
#: How long a worker may wait for the next plan (an idle engine sends none).
IDLE_TIMEOUT = timedelta(days=30)


#: How long rank 0 waits for every worker to confirm its exit (and a worker for rank 0).
EXIT_TIMEOUT_S = 30.0


def exit_barrier(group: Any, timeout_s: float = EXIT_TIMEOUT_S) -> None:
    """Every rank has the exit: a barrier bounded by ``timeout_s`` (gloo's monitored
    barrier, not the group's idle timeout), which every rank of ``group`` calls."""
    try:
        torch.distributed.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s))
    except RuntimeError as error:
        raise CollectiveError(f"waiting for the ranks to exit failed: {error}") from error


def plan_group() -> Any:
    """A gloo group for plans (a collective: every rank calls it, in the same order)."""
    return torch.distributed.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


class BroadcastPlanSender:
    """Rank 0's side."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.sequence = 0
        self._closed = False

    def publish(self, plan: Any, input_ids: np.ndarray) -> None:
        lengths = plan_lengths(plan, input_ids)
        self.sequence += 1
        header = torch.tensor(
            [self.sequence, plan.step_id, lengths["tokens"], lengths["rows"], lengths["logits"],
             lengths["block_writes"], STEP, lengths["prompt_logits"], getattr(plan, "prompt_slice", 0),
             lengths["samples"], lengths["drafts"], lengths["table_writes"], lengths["group_slots"]],
            dtype=torch.int64,
        )
        special = {"input_ids": input_ids, "prompt_logits_indices": prompt_positions(plan),
                   "num_draft_tokens": draft_counts(plan), "draft_token_ids": draft_ids(plan),
                   "block_table_groups": table_groups(plan), "group_slot_mapping": group_slots(plan)}
        parts = [np.asarray(special[name] if name in special else getattr(plan, name), dtype=np.int64)
                 for name, _, _ in ARRAYS]
        payload = torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros(0, dtype=torch.int64)
        self._broadcast(header)
        self._broadcast(payload)

    def close(self, timeout_s: float = EXIT_TIMEOUT_S) -> None:
        """Tells every worker to exit and waits, at most ``timeout_s``, until each has
        heard it (a ``CollectiveError`` naming the missing ranks after that)."""
        if self._closed:
            return
        self._closed = True
        header = torch.zeros(_HEADER_LENGTH, dtype=torch.int64)
        header[0], header[6] = self.sequence + 1, EXIT
        self._broadcast(header)
        exit_barrier(self.group, timeout_s)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        try:
            torch.distributed.broadcast(tensor, src=0, group=self.group)
        except RuntimeError as error:
            raise CollectiveError(f"broadcasting the plan failed: {error}") from error


class BroadcastPlanReceiver:
    """A worker's side: ``receive`` blocks until the next plan (None: exit)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.header = torch.zeros(_HEADER_LENGTH, dtype=torch.int64)

    def receive(self) -> Optional[ForwardPlan]:
        self._broadcast(self.header)
        (sequence, step_id, tokens, rows, logits, block_writes, kind, prompt_logits, prompt_slice, samples,
         drafts, table_writes, slots) = self.header.tolist()
        if kind == EXIT:
            return None
        lengths = {"tokens": tokens, "rows": rows, "logits": logits, "block_writes": block_writes,
                   "prompt_logits": prompt_logits, "samples": samples, "drafts": drafts,
                   "table_writes": table_writes, "group_slots": slots}
        total = sum(lengths[field] + extra for _, field, extra in ARRAYS)
        payload = torch.empty(total, dtype=torch.int64)
        self._broadcast(payload)
        flat = payload.numpy()
        plan = ForwardPlan()
        plan.step_id = step_id
        plan.prompt_slice = prompt_slice
        offset = 0
        for name, field, extra in ARRAYS:
            size = lengths[field] + extra
            setattr(plan, name, flat[offset : offset + size])
            offset += size
        return plan

    def _broadcast(self, tensor: torch.Tensor) -> None:
        try:
            torch.distributed.broadcast(tensor, src=0, group=self.group)
        except RuntimeError as error:
            raise CollectiveError(f"receiving the plan failed (rank 0 gone?): {error}") from error
