"""Log-probabilities across the process link: the engine's own arrays, as they are.

A ``LogprobArrays`` (``pyengine/logprob_arrays.py``: a sample's new tokens, or a prompt's
tokens after the first) crosses as its five arrays, each one raw frame (``wire.Codec``),
with nothing converted on either side. The decoded token strings do not cross: the front
end has the tokenizer and makes ``Logprob.decoded_token`` itself, only if a caller reads
the ``{token id: Logprob}`` maps.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from pyengine.logprob_arrays import LogprobArrays, Piece


class WireLogprobs(msgspec.Struct, array_like=True):
    token_ids: Any  # np.ndarray int64 [P]: each position's own token
    logprobs: Any  # np.ndarray float32 [P]
    ranks: Any  # np.ndarray int64 [P]
    top_token_ids: Any  # np.ndarray int64 [P, k]
    top_logprobs: Any  # np.ndarray float32 [P, k]


def logprobs_to_wire(arrays: LogprobArrays) -> WireLogprobs:
    return WireLogprobs(arrays.token_ids, arrays.logprobs, arrays.ranks, arrays.top_token_ids, arrays.top_logprobs)


_KINDS = (("token_ids", "i", 1), ("logprobs", "f", 1), ("ranks", "i", 1), ("top_token_ids", "i", 2),
          ("top_logprobs", "f", 2))


def logprobs_from_wire(w: WireLogprobs, piece: Piece) -> LogprobArrays:
    """The arrays back, with this side's ``piece``; raises ``ValueError`` when they are not
    the arrays the engine sends (a broken peer): numbers of the right kinds and shapes."""
    arrays = [w.token_ids, w.logprobs, w.ranks, w.top_token_ids, w.top_logprobs]
    for value, (name, kind, ndim) in zip(arrays, _KINDS):
        if not isinstance(value, np.ndarray) or value.dtype.kind != kind or value.ndim != ndim:
            raise ValueError(f"logprob array {name} is not a {ndim}-d array of kind {kind!r}")
    positions = len(w.token_ids)
    if not all(len(a) == positions for a in arrays):
        raise ValueError(f"logprob arrays disagree: {positions} positions, then {[len(a) for a in arrays]}")
    if w.top_token_ids.shape != w.top_logprobs.shape:
        raise ValueError(f"logprob top arrays disagree: {w.top_token_ids.shape} and {w.top_logprobs.shape}")
    return LogprobArrays(*arrays, piece=piece)
