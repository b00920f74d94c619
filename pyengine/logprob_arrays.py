"""Log-probabilities as the engine carries them: arrays, from the executor to the API edge.

A run of positions (a sample's generated tokens, or a prompt's tokens after the first)
is five arrays: per position the position's own token (sampled, or the prompt's), its
log-probability and its true rank in the vocabulary, and the top ``k`` tokens with their
log-probabilities, best first (their ranks are 1..k). The engine core's output thread
fills them, the process link sends them as they are (raw frames), the front end keeps
adding to them; only the edge that needs another shape builds it, once: the
``dict[int, Logprob]`` lists of vLLM's API (``CompletionOutput.logprobs``,
``RequestOutput.prompt_logprobs``, built on first read), or the OpenAI formats on the
server. Tokens that top-k / top-p / min-p excluded (-inf) are already ``LOGPROB_FLOOR``
here: the floor is applied once, when a position enters a buffer.

``entries`` is the one rule for what a position holds as a map: the position's token
first, then the top-k without it (so k or k + 1 entries).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from pyengine.logprobs import Logprob

#: Tokens that top-k / top-p / min-p excluded have a log-probability of -inf, which JSON
#: cannot carry; like vLLM's server they are reported as this floor.
LOGPROB_FLOOR = -9999.0

#: A token's text on its own (``Logprob.decoded_token``); None: the request does not detokenize.
Piece = Optional[Callable[[int], str]]


@dataclass(frozen=True, eq=False)
class LogprobArrays:
    """``P`` positions; ``top_*`` are ``[P, k]``, k the request's ``logprobs`` (or
    ``prompt_logprobs``). ``piece`` fills ``Logprob.decoded_token`` when maps are built."""

    token_ids: np.ndarray  # int64 [P]
    logprobs: np.ndarray  # float32 [P]
    ranks: np.ndarray  # int64 [P]
    top_token_ids: np.ndarray  # int64 [P, k]
    top_logprobs: np.ndarray  # float32 [P, k]
    piece: Piece = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def width(self) -> int:
        return int(self.top_token_ids.shape[1])

    def rows(self) -> list[list[tuple[int, float, int]]]:
        """Each position's ``entries``: (token id, log-probability, rank) tuples."""
        return [entries(t, v, r, tops, top_values) for t, v, r, tops, top_values in
                zip(self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist(),
                    self.top_token_ids.tolist(), self.top_logprobs.tolist())]

    def to_dicts(self) -> list[dict[int, Logprob]]:
        """vLLM's shape: one ``{token id: Logprob}`` per position."""
        piece = self.piece
        if piece is None:
            return [{t: Logprob(v, r) for t, v, r in row} for row in self.rows()]
        return [{t: Logprob(v, r, piece(t)) for t, v, r in row} for row in self.rows()]


def entries(token: int, value: float, rank: int, tops: list[int],
            top_values: list[float]) -> list[tuple[int, float, int]]:
    """One position as (token id, log-probability, rank): its own token first with its true
    rank, then the top-k ranked 1..k, leaving out the position's token if among them."""
    out = [(token, value, rank)]
    out += [(t, v, r) for r, (t, v) in enumerate(zip(tops, top_values), start=1) if t != token]
    return out


class LogprobBuffer:
    """Positions added at the end (a sample's tokens) or written in place (a prompt's, as its
    chunks are computed), in arrays that double when full. ``view`` hands out a slice
    without copying: written positions are never written again, so a view stays valid."""

    __slots__ = ("width", "piece", "size", "_ids", "_values", "_ranks", "_top_ids", "_top_values")

    def __init__(self, width: int, piece: Piece = None, capacity: int = 16) -> None:
        self.width = width
        self.piece = piece
        self.size = 0  # positions written: the first ``size`` (appends) or all of them (in place)
        capacity = max(1, capacity)
        self._ids = np.zeros(capacity, dtype=np.int64)
        self._values = np.zeros(capacity, dtype=np.float32)
        self._ranks = np.zeros(capacity, dtype=np.int64)
        self._top_ids = np.zeros((capacity, width), dtype=np.int64)
        self._top_values = np.zeros((capacity, width), dtype=np.float32)

    def __len__(self) -> int:
        return self.size

    def _reserve(self, size: int) -> None:
        capacity = len(self._ids)
        if size <= capacity:
            return
        capacity = max(size, 2 * capacity)
        for name in ("_ids", "_values", "_ranks", "_top_ids", "_top_values"):
            old = getattr(self, name)
            new = np.zeros((capacity, *old.shape[1:]), dtype=old.dtype)
            new[:len(old)] = old
            setattr(self, name, new)

    def append(self, token: int, value: float, rank: int, tops: np.ndarray, top_values: np.ndarray) -> float:
        """One position at the end (a sampled token): ``tops`` / ``top_values`` hold at least
        ``width`` entries, best first. Returns the log-probability as stored (floored)."""
        if len(tops) < self.width:  # a vocabulary smaller than the k asked for: all of it
            self._narrow(len(tops))
        at = self.size
        self._reserve(at + 1)
        value = max(value, LOGPROB_FLOOR)
        self._ids[at] = token
        self._values[at] = value
        self._ranks[at] = rank
        width = self.width
        self._top_ids[at] = tops[:width]
        np.maximum(top_values[:width], LOGPROB_FLOOR, out=self._top_values[at])
        self.size = at + 1
        return value

    def _narrow(self, width: int) -> None:
        if self.size:
            raise ValueError(f"log-probability rows of width {width} after rows of width {self.width}")
        self.width = width
        self._top_ids = self._top_ids[:, :width].copy()
        self._top_values = self._top_values[:, :width].copy()

    def extend(self, rows: LogprobArrays) -> None:
        """Positions already in arrays (a delta that crossed the process link) at the end."""
        at, end = self.size, self.size + len(rows)
        self._reserve(end)
        self._put(slice(at, end), rows.token_ids, rows.logprobs, rows.ranks, rows.top_token_ids, rows.top_logprobs)
        self.size = end

    def put(self, positions: np.ndarray, ids: np.ndarray, values: np.ndarray, ranks: np.ndarray, tops: np.ndarray,
            top_values: np.ndarray) -> None:
        """Positions written in place (a prompt's chunk), within the capacity the buffer was
        made with; the top arrays may be wider than ``width`` (their first columns count)."""
        if len(positions):
            self._put(positions, ids, values, ranks, tops, top_values)
            self.size = max(self.size, int(positions.max()) + 1)

    def _put(self, at: Any, ids: np.ndarray, values: np.ndarray, ranks: np.ndarray, tops: np.ndarray,
             top_values: np.ndarray) -> None:
        width = self.width
        self._ids[at] = ids
        self._values[at] = np.maximum(values, LOGPROB_FLOOR)
        self._ranks[at] = ranks
        self._top_ids[at] = tops[:, :width]
        self._top_values[at] = np.maximum(top_values[:, :width], LOGPROB_FLOOR)

    def view(self, start: int = 0, stop: Optional[int] = None) -> LogprobArrays:
        stop = self.size if stop is None else stop
        return LogprobArrays(self._ids[start:stop], self._values[start:stop], self._ranks[start:stop],
                             self._top_ids[start:stop], self._top_values[start:stop], self.piece)
