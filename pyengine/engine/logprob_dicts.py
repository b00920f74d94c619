"""From the executor's log-probability arrays to the ``dict[int, Logprob]`` callers get.

The output thread calls these once per token (sampled or prompt) of a request that asked.
Ranks: the chosen token's true rank in the vocabulary (computed on the device), and
1..k for the top-k in order. ``piece`` gives a token's text (``Logprob.decoded_token``),
None when the request does not detokenize. Tokens that top-k / top-p / min-p excluded
have a log-probability of -inf, reported as ``LOGPROB_FLOOR``.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from pyengine.logprobs import Logprob
from pyengine.outputs import LOGPROB_FLOOR

Piece = Optional[Callable[[int], str]]


def logprob_dict(chosen: int, chosen_logprob: float, chosen_rank: int, top_ids: np.ndarray,
                 top_logprobs: np.ndarray, piece: Piece) -> dict[int, Logprob]:
    """The chosen token first, then the top-k (``top_ids`` / ``top_logprobs`` [k], best
    first); a top-k entry that is the chosen token keeps the chosen token's entry."""
    out = {chosen: Logprob(max(float(chosen_logprob), LOGPROB_FLOOR), int(chosen_rank),
                           piece(chosen) if piece is not None else None)}
    for rank, (token, value) in enumerate(zip(top_ids.tolist(), top_logprobs.tolist()), start=1):
        if token not in out:
            out[token] = Logprob(max(float(value), LOGPROB_FLOOR), rank, piece(token) if piece is not None else None)
    return out


def sample_logprob_dict(lp, i: int, token: int, piece: Piece) -> dict[int, Logprob]:
    """Entry ``i`` of a step's ``LogprobsOutput`` (the sampled ``token``), with the top-k
    that entry's request asked for."""
    k = int(lp.requested[i])
    return logprob_dict(token, lp.sampled_logprobs[i], lp.sampled_ranks[i], lp.top_token_ids[i, :k],
                        lp.top_logprobs[i, :k], piece)


def prompt_logprob_dicts(plp, r: int, piece: Piece) -> list[dict[int, Logprob]]:
    """Row ``r`` of a step's ``PromptLogprobsOutput``: one dict per prompt token it covers
    (the prompt token first, then the top-k its request asked for)."""
    lo, hi = int(plp.offsets[r]), int(plp.offsets[r + 1])
    k = int(plp.requested[r])
    return [
        logprob_dict(token, value, rank, plp.top_token_ids[j, :k], plp.top_logprobs[j, :k], piece)
        for j, token, value, rank in zip(range(lo, hi), plp.token_ids[lo:hi].tolist(), plp.logprobs[lo:hi].tolist(),
                                         plp.ranks[lo:hi].tolist())
    ]
