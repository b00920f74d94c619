"""The logits processors' view of the persistent batch: a dense batch index per request.

Persistent-batch rows are stable but sparse, and a step samples some of them in the
scheduler's order. Processors index their state by *batch index* and receive a logits
tensor whose row ``i`` is index ``i`` (docs/logits_processors.md). This class keeps the
mapping and, before each step, turns what changed (rows freed, rows installed, the
step's sample order) into one :class:`BatchUpdate`:

1. freed rows give up their index (``removed``);
2. installed rows take the lowest free index, else the next one (``added``);
3. the step's sampled rows are brought to indices ``0 .. S-1`` in sample order, and the
   rows that hold state but sample nothing this step packed after them (``moved``); a
   row that does not sample and already sits in ``S .. batch_size - 1`` stays put.

The new layout is computed as one permutation, with numpy (``BatchUpdate.permutation``):
the built-in processors apply it with one indexed copy per table, so a request leaving
the front of the batch (every other index shifts by one) costs the same as any other
change. ``moved``, vLLM's list of swaps, is only listed if a custom processor reads it.

A step whose rows sample in the same order as the previous one (the steady decode
state) costs one array comparison and produces no update.
"""

from __future__ import annotations

import heapq
from typing import Optional

import numpy as np

from pyengine.errors import StepResultError
from pyengine.logits_processors.interface import AddedRequest, BatchUpdate, PermutationMoves
from pyengine.sampling_params import SamplingParams

_FREE = -1


class ProcessorBatchError(StepResultError, ValueError):
    """A step samples a row that holds no sampling request (a plan/state mismatch)."""


class ProcessorBatch:
    def __init__(self, max_rows: int) -> None:
        self.row_at = np.full(max_rows, _FREE, dtype=np.int64)  # batch index -> row
        self.index_of = np.full(max_rows, _FREE, dtype=np.int64)  # row -> batch index
        self.last_sample_rows = np.zeros(0, dtype=np.int64)  # at indices 0 .. S-1 now
        self.size = 0  # indices in use are 0 .. size-1 after each update
        # Per row: what an ``added`` entry carries; the output list is appended to by
        # ``record_sampled`` and handed to processors by reference (vLLM's contract).
        self.held: dict[int, AddedRequest] = {}
        self.outputs_at: list[Optional[list[int]]] = [None] * max_rows  # by batch index
        self._removed: list[int] = []
        self._pending: list[int] = []  # rows installed, not yet given an index
        # Per row: a built-in field that can mask every token (see ``masked_rows``).
        self.restricts = np.zeros(max_rows, dtype=bool)

    def install(self, row: int, params: SamplingParams, prompt: Optional[list[int]], outputs: list[int]) -> None:
        """A sampling sequence entered ``row`` (after any ``free`` of the same row)."""
        self.held[row] = (_FREE, params, prompt, outputs)
        self._pending.append(row)
        self.restricts[row] = bool(params.allowed_token_ids or params._bad_words_token_ids)

    def free(self, rows: np.ndarray) -> None:
        """Rows released by the plan (rows this batch never held are ignored)."""
        for row in rows.tolist():
            if self.held.pop(row, None) is None:
                continue
            self.restricts[row] = False
            index = int(self.index_of[row])
            if index == _FREE:  # installed and freed before it ever took an index
                self._pending.remove(row)
                continue
            self.index_of[row] = _FREE
            self.row_at[index] = _FREE
            self.outputs_at[index] = None
            self._removed.append(index)

    def step(self, sample_rows: np.ndarray) -> Optional[BatchUpdate]:
        """The update that lays the batch out for a step sampling ``sample_rows`` (in
        order), or None when nothing changed."""
        if not self._removed and not self._pending and np.array_equal(self.last_sample_rows, sample_rows):
            return None
        removed, self._removed = self._removed, []
        free = list(removed)
        heapq.heapify(free)
        added: list[AddedRequest] = []
        for row in self._pending:
            index = heapq.heappop(free) if free else self._grow()
            _, params, prompt, outputs = self.held[row]
            self.row_at[index] = row
            self.index_of[row] = index
            self.outputs_at[index] = outputs
            added.append((index, params, prompt, outputs))
        self._pending = []
        sample = np.asarray(sample_rows, dtype=np.int64)
        permutation = self._layout(sample)
        live = len(permutation)
        moved = not np.array_equal(permutation, np.arange(live))
        if moved:
            rows = self.row_at[permutation]
            outputs = [self.outputs_at[i] for i in permutation.tolist()]
            self.row_at[:live] = rows
            self.index_of[rows] = np.arange(live)
            self.outputs_at[:live] = outputs
        self.row_at[live:self.size] = _FREE
        self.outputs_at[live:self.size] = [None] * (self.size - live)
        self.size = live
        self.last_sample_rows = sample.copy()
        if not moved:
            return BatchUpdate(batch_size=live, removed=removed, added=added, moved=[])
        return BatchUpdate(batch_size=live, removed=removed, added=added, moved=PermutationMoves(permutation),
                           permutation=permutation)

    def _layout(self, sample: np.ndarray) -> np.ndarray:
        """The permutation that brings ``sample`` to indices ``0 .. S-1`` and packs the
        other held rows after them (those already there stay)."""
        live = len(self.held)
        source = self.index_of[sample]
        if len(source) and (source == _FREE).any():
            bad = int(sample[np.argmax(source == _FREE)])
            raise ProcessorBatchError(f"row {bad} samples but holds no sampling request")
        n = len(sample)
        permutation = np.empty(live, dtype=np.int64)
        permutation[:n] = source
        if n < live:
            occupied = np.flatnonzero(self.row_at[: self.size] != _FREE)
            sampled = np.zeros(self.size, dtype=bool)
            sampled[source] = True
            rest = occupied[~sampled[occupied]]
            in_place = (rest >= n) & (rest < live)
            stay = rest[in_place]
            permutation[stay] = stay
            holes = np.ones(live - n, dtype=bool)
            holes[stay - n] = False
            permutation[n + np.flatnonzero(holes)] = rest[~in_place]
        return permutation

    def _grow(self) -> int:
        self.size += 1
        return self.size - 1

    def all_added(self) -> BatchUpdate:
        """Every request as ``added`` at its current index (to fill fresh processors)."""
        added = [(int(self.index_of[row]), params, prompt, outputs)
                 for row, (_, params, prompt, outputs) in self.held.items() if self.index_of[row] != _FREE]
        return BatchUpdate(batch_size=self.size, removed=[], added=added, moved=[])

    def record_sampled(self, token_ids: list[int]) -> None:
        """Appends each sampled token to its request's output list (index ``i`` sampled
        ``token_ids[i]``)."""
        for outputs, token in zip(self.outputs_at, token_ids):
            outputs.append(token)  # type: ignore[union-attr]
