"""allowed_token_ids: only the listed tokens may be sampled (every other logit -> -inf)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from pyengine.logits_processors.index_state import move_entries
from pyengine.logits_processors.interface import BatchUpdate, LogitsProcessor


class AllowedTokenIdsLogitsProcessor(LogitsProcessor):
    """A persistent ``[max_num_seqs, vocab]`` mask of forbidden tokens, one row (a slot)
    per restricted request, written once when the request is added and kept for its
    lifetime; a batch index maps to its request's slot, and moves re-key that map only.
    When the batch changes, the step's restricted rows are gathered from the mask once
    (one ``index_select``); each step fills them in one call. The mask (one byte per
    token and slot) is allocated with the first restricted request."""

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        self.slot_of: dict[int, int] = {}  # batch index -> mask row
        self._free_slots = list(range(int(config.max_num_seqs) - 1, -1, -1))
        self.mask: Optional[torch.Tensor] = None  # [max_num_seqs, vocab] bool, True = forbidden
        self._unwritten: dict[int, list[int]] = {}  # slot -> allowed ids, until the vocabulary is known
        self._cached: Optional[tuple[int, torch.Tensor, torch.Tensor]] = None

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        if batch_update is None:
            return
        changed = False
        if self.slot_of:
            for index in batch_update.removed:
                changed |= self._release(index)
        for index, params, _prompt, _outputs in batch_update.added:
            changed |= self._release(index)
            if params.allowed_token_ids:
                slot = self._free_slots.pop()
                self.slot_of[index] = slot
                self._write(slot, params.allowed_token_ids)
                changed = True
        if move_entries(self.slot_of, batch_update) or changed:
            self._cached = None

    def _release(self, index: int) -> bool:
        slot = self.slot_of.pop(index, None)
        if slot is None:
            return False
        self._unwritten.pop(slot, None)
        self._free_slots.append(slot)
        return True

    def _write(self, slot: int, allowed: list[int]) -> None:
        if self.mask is None:
            self._unwritten[slot] = allowed
            return
        row = self.mask[slot]
        row.fill_(True)
        row[torch.tensor(allowed, dtype=torch.int64, device=row.device)] = False

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.slot_of:
            return logits
        n, vocab = logits.shape
        if self.mask is None:
            slots = len(self._free_slots) + len(self.slot_of)
            self.mask = torch.ones(slots, vocab, dtype=torch.bool, device=logits.device)
            unwritten, self._unwritten = self._unwritten, {}
            for slot, allowed in unwritten.items():
                self._write(slot, allowed)
        if self._cached is None or self._cached[0] != n:  # once per batch change, not per step
            pairs = sorted((i, s) for i, s in self.slot_of.items() if i < n)
            rows = torch.tensor([i for i, _ in pairs], dtype=torch.int64, device=logits.device)
            slots = torch.tensor([s for _, s in pairs], dtype=torch.int64, device=logits.device)
            self._cached = (n, rows, self.mask.index_select(0, slots))
        _, rows, forbidden = self._cached
        if rows.numel() == n:  # every row restricted: in place, no gather
            logits.masked_fill_(forbidden, float("-inf"))
        elif rows.numel():
            logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(forbidden, float("-inf")))
        return logits
