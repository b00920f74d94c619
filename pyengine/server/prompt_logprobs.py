"""vLLM's ``prompt_logprobs`` response field (completions' choices, chat's response)."""

from __future__ import annotations

from typing import Any, Optional

from pyengine.logprob_arrays import LogprobArrays


def prompt_logprobs_json(prompt_logprobs: Optional[LogprobArrays]) -> Optional[list[Optional[dict[int, Any]]]]:
    """From the engine's arrays: None for the first prompt token, then token id ->
    {logprob, rank, decoded_token} (JSON turns the ids into strings, as vLLM's server
    writes them)."""
    if prompt_logprobs is None:
        return None
    piece = prompt_logprobs.piece
    return [None, *({t: {"logprob": v, "rank": r, "decoded_token": piece(t) if piece is not None else None}
                     for t, v, r in row} for row in prompt_logprobs.rows())]
