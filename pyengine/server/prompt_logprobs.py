"""vLLM's ``prompt_logprobs`` response field (completions' choices, chat's response)."""

from __future__ import annotations

from typing import Any, Optional

from pyengine.logprobs import PromptLogprobs


def prompt_logprobs_json(prompt_logprobs: Optional[PromptLogprobs]) -> Optional[list[Optional[dict[int, Any]]]]:
    """None for the first prompt token, then token id -> {logprob, rank, decoded_token}
    (JSON turns the ids into strings, as vLLM's server writes them)."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else
            {t: {"logprob": v.logprob, "rank": v.rank, "decoded_token": v.decoded_token} for t, v in entry.items()}
            for entry in prompt_logprobs]
