"""Helpers that apply a :class:`BatchUpdate` to a processor's per-index state.

An update the engine builds carries its moves as one permutation too
(``BatchUpdate.permutation``): these helpers apply it in one step (one indexed copy per
table, one pass over a dict's entries) and fall back to the ``moved`` list for an update
built without one."""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

import numpy as np
import torch

from pyengine.logits_processors.interface import BatchUpdate, MoveDirectionality
from pyengine.sampling_params import SamplingParams

T = TypeVar("T")

#: Builds a request's state from its (params, prompt token ids, output token ids); None
#: when the processor has nothing to do for it.
MakeState = Callable[[SamplingParams, Optional[list[int]], list[int]], Optional[T]]


def update_entries(entries: dict[int, T], update: Optional[BatchUpdate], make: MakeState) -> bool:
    """Applies ``update`` to ``entries`` (batch index -> state; only requests the processor
    acts on have one). Returns whether anything changed."""
    if update is None:
        return False
    changed = False
    if entries:
        for index in update.removed:
            changed |= entries.pop(index, None) is not None
    for index, params, prompt, outputs in update.added:
        state = make(params, prompt, outputs)
        if state is not None:
            entries[index] = state
            changed = True
        else:
            changed |= entries.pop(index, None) is not None
    return move_entries(entries, update) or changed


def move_entries(entries: dict[int, T], update: BatchUpdate) -> bool:
    """Re-keys ``entries`` (batch index -> state) as ``update`` moves the requests.
    Returns whether any entry moved."""
    if not entries:
        return False
    permutation = update.permutation
    if permutation is None:
        changed = False
        for a, b, direction in update.moved:
            moving, other = entries.pop(a, None), entries.pop(b, None)
            if moving is not None:
                entries[b] = moving
            if other is not None and direction is MoveDirectionality.SWAP:
                entries[a] = other
            changed |= moving is not None or other is not None
        return changed
    new_index = _new_indices(permutation, max(entries) + 1)
    moved = {int(new_index[i]): state for i, state in entries.items() if new_index[i] >= 0}
    changed = any(int(new_index[i]) != i for i in entries)  # a dropped entry maps to -1
    entries.clear()
    entries.update(moved)
    return changed


def _new_indices(permutation: np.ndarray, size: int) -> np.ndarray:
    """Old index -> new index (-1: no request there)."""
    new_index = np.full(max(size, int(permutation.max()) + 1 if len(permutation) else 0), -1, dtype=np.int64)
    new_index[permutation] = np.arange(len(permutation))
    return new_index


def move_rows(update: BatchUpdate, *tables: "np.ndarray | torch.Tensor") -> None:
    """Moves the rows of per-index tables (numpy arrays or tensors, indexed by batch index
    on their first axis) as ``update`` says: one indexed copy per table."""
    permutation = update.permutation
    if permutation is not None:
        n = len(permutation)
        index: Optional[torch.Tensor] = None
        for table in tables:
            if isinstance(table, np.ndarray):
                table[:n] = table[permutation]  # the right side is a copy
            else:
                if index is None or index.device != table.device:
                    index = torch.from_numpy(permutation).to(table.device)
                table[:n] = table.index_select(0, index)
        return
    for a, b, direction in update.moved:
        for table in tables:
            if direction is MoveDirectionality.SWAP:
                row_a = table[a].copy() if isinstance(table, np.ndarray) else table[a].clone()
                table[a] = table[b]
                table[b] = row_a
            else:
                table[b] = table[a]
