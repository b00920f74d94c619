"""Log-probabilities as callers get them, with vLLM's names (``vllm.logprobs``), so that
code reading ``output.logprobs[i][token].logprob`` / ``.rank`` / ``.decoded_token`` moves
over by changing an import."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["Logprob", "PromptLogprobs", "SampleLogprobs"]


@dataclass
class Logprob:
    """One token's log-probability in one position's distribution (vLLM's ``Logprob``).

    ``rank``: 1 for the most likely token of the vocabulary; the sampled (or prompt) token
    carries its true rank even when it lies outside the top-k asked for. ``decoded_token``:
    the token's text on its own (``tokenizer.decode([id])``), filled when the request
    detokenizes, else None."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# One dict per generated token: token id -> its Logprob, for the sampled token plus the
# top-k (k = ``SamplingParams.logprobs``); the sampled token comes first.
SampleLogprobs = list[dict[int, Logprob]]

# One entry per prompt token: None for the first (nothing predicts it), then token id ->
# Logprob for that prompt token plus the top-k (k = ``SamplingParams.prompt_logprobs``).
PromptLogprobs = list[Optional[dict[int, Logprob]]]
