"""min_tokens: a request's EOS and stop tokens are forbidden until it has produced
``min_tokens`` outputs (vLLM semantics; stop strings are not affected)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import torch

from pyengine.logits_processors.index_state import move_rows
from pyengine.logits_processors.interface import BatchUpdate, LogitsProcessor


class MinTokensLogitsProcessor(LogitsProcessor):
    """Per batch index: outputs so far, ``min_tokens``, and the ids to forbid (padded with
    -1). Each step masks the stop ids of the indices still below their minimum, in one
    indexed write."""

    def __init__(
        self, config: Any, device: torch.device, is_pin_memory: bool, eos_token_ids: Sequence[int] = ()
    ) -> None:
        rows = int(config.max_num_seqs)
        self.device = device
        self.eos_token_ids = tuple(eos_token_ids)
        self.count = np.zeros(rows, dtype=np.int64)
        self.minimum = np.zeros(rows, dtype=np.int64)
        self.stop_ids = np.full((rows, 0), -1, dtype=np.int64)
        self.active = 0  # indices with a minimum (skip everything when none)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        if batch_update is None:
            return
        if not self.active and not any(params.min_tokens for _, params, _, _ in batch_update.added):
            return  # no minimum before or after: nothing to keep (every minimum is 0)
        for index in batch_update.removed:
            self.minimum[index] = 0
        for index, params, _prompt, outputs in batch_update.added:
            self.count[index] = len(outputs)
            self.minimum[index] = params.min_tokens
            self.stop_ids[index] = -1
            if params.min_tokens > 0:
                ids = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(self.eos_token_ids))
                self._set_stop_ids(index, sorted(ids))
        move_rows(batch_update, self.count, self.minimum, self.stop_ids)
        self.active = int(np.count_nonzero(self.minimum))

    def _set_stop_ids(self, index: int, ids: list[int]) -> None:
        width = self.stop_ids.shape[1]
        if len(ids) > width:
            extra = np.full((self.stop_ids.shape[0], len(ids) - width), -1, dtype=np.int64)
            self.stop_ids = np.concatenate([self.stop_ids, extra], axis=1)
        self.stop_ids[index, : len(ids)] = ids

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return logits
        n = logits.shape[0]
        below = np.flatnonzero(self.count[:n] < self.minimum[:n])
        if below.size == 0:
            return logits
        ids = self.stop_ids[below]
        entry, column = np.nonzero(ids >= 0)
        if entry.size:
            rows = torch.from_numpy(below[entry]).to(logits.device)
            tokens = torch.from_numpy(ids[entry, column]).to(logits.device)
            logits[rows, tokens] = float("-inf")
        return logits

    def record_sampled(self, token_ids: torch.Tensor) -> None:
        self.count[: len(token_ids)] += 1
