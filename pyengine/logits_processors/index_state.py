"""Helpers that apply a :class:`BatchUpdate` to a processor's per-index state."""

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
    for a, b, direction in update.moved if entries else ():
        moving, other = entries.pop(a, None), entries.pop(b, None)
        if moving is not None:
            entries[b] = moving
        if other is not None and direction is MoveDirectionality.SWAP:
            entries[a] = other
        changed |= moving is not None or other is not None
    return changed


def move_rows(update: BatchUpdate, *tables: "np.ndarray | torch.Tensor") -> None:
    """Moves the rows of per-index tables (numpy arrays or tensors, indexed by batch index
    on their first axis) as ``update.moved`` says."""
    for a, b, direction in update.moved:
        for table in tables:
            if direction is MoveDirectionality.SWAP:
                row_a = table[a].copy() if isinstance(table, np.ndarray) else table[a].clone()
                table[a] = table[b]
                table[b] = row_a
            else:
                table[b] = table[a]
