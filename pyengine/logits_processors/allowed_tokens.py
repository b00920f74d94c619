"""allowed_token_ids: only the listed tokens may be sampled (every other logit -> -inf)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from pyengine.logits_processors.index_state import update_entries
from pyengine.logits_processors.interface import BatchUpdate, LogitsProcessor


class AllowedTokenIdsLogitsProcessor(LogitsProcessor):
    """Keeps, for the restricted indices of the step, a ``[n, vocab]`` mask of forbidden
    tokens, built when the batch changes; each step fills those rows in one call."""

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        self.allowed: dict[int, list[int]] = {}
        self._cached: Optional[tuple[int, torch.Tensor, torch.Tensor]] = None

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        if update_entries(self.allowed, batch_update, lambda params, _p, _o: params.allowed_token_ids or None):
            self._cached = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.allowed:
            return logits
        n, vocab = logits.shape
        if self._cached is None or self._cached[0] != n:
            indices = sorted(i for i in self.allowed if i < n)
            forbidden = torch.ones(len(indices), vocab, dtype=torch.bool, device=logits.device)
            for k, index in enumerate(indices):  # once per batch change, not per step
                forbidden[k, torch.tensor(self.allowed[index], dtype=torch.int64, device=logits.device)] = False
            self._cached = (n, torch.tensor(indices, dtype=torch.int64, device=logits.device), forbidden)
        _, rows, forbidden = self._cached
        if rows.numel() == n:  # every row restricted: in place, no gather
            logits.masked_fill_(forbidden, float("-inf"))
        elif rows.numel():
            logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(forbidden, float("-inf")))
        return logits
