"""Log-probabilities across the process link as arrays, not per-token maps.

A ``list[dict[int, Logprob]]`` (a sample's tokens, or a prompt's with None first) becomes
four flat arrays, each riding as one raw frame (see ``wire.Codec``): how many entries
each position has (-1 for a None position), and every entry's token id, log-probability
and rank in order; the decoded token strings, when the request detokenized, as one list.
A prompt of 4,000 tokens with 5 top logprobs is then four frames and one list, where maps
would be 4,000 msgpack maps of Logprob-shaped tuples.
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec
import numpy as np

from pyengine.logprobs import Logprob

Positions = list[Optional[dict[int, Logprob]]]

_NO_RANK = -1  # a Logprob without a rank (never produced by this engine, kept for peers)


class WireLogprobs(msgspec.Struct, array_like=True):
    counts: Any  # np.ndarray int32 [P]: entries of each position, -1 = None
    token_ids: Any  # np.ndarray int64 [N]
    logprobs: Any  # np.ndarray float32 [N] (the engine computes them in float32)
    ranks: Any  # np.ndarray int64 [N], -1 = no rank
    decoded: Optional[list[str]] = None  # [N] when every entry has its decoded token


def logprobs_to_wire(positions: Positions) -> WireLogprobs:
    counts = np.fromiter((-1 if p is None else len(p) for p in positions), dtype=np.int32, count=len(positions))
    entries = [(t, lp) for p in positions if p is not None for t, lp in p.items()]
    decoded = [lp.decoded_token for _, lp in entries]
    return WireLogprobs(
        counts=counts,
        token_ids=np.fromiter((t for t, _ in entries), dtype=np.int64, count=len(entries)),
        logprobs=np.fromiter((lp.logprob for _, lp in entries), dtype=np.float32, count=len(entries)),
        ranks=np.fromiter((_NO_RANK if lp.rank is None else lp.rank for _, lp in entries), dtype=np.int64,
                          count=len(entries)),
        decoded=decoded if all(d is not None for d in decoded) and entries else None,  # type: ignore[arg-type]
    )


def logprobs_from_wire(w: WireLogprobs) -> Positions:
    """The positions back; raises ``ValueError`` when the arrays disagree (a broken peer)."""
    counts = np.asarray(w.counts).tolist()
    ids, values, ranks = (np.asarray(a).tolist() for a in (w.token_ids, w.logprobs, w.ranks))
    total = sum(c for c in counts if c > 0)
    if not (len(ids) == len(values) == len(ranks) == total) or (w.decoded is not None and len(w.decoded) != total):
        raise ValueError(f"logprob arrays disagree: {total} entries counted, {len(ids)} token ids")
    out: Positions = []
    at = 0
    for count in counts:
        if count < 0:
            out.append(None)
            continue
        out.append({
            ids[j]: Logprob(values[j], None if ranks[j] == _NO_RANK else ranks[j],
                            w.decoded[j] if w.decoded is not None else None)
            for j in range(at, at + count)
        })
        at += count
    return out
