"""What ``LLM.beam_search`` returns, with vLLM's names: one ``BeamSearchOutput`` per prompt,
holding its best sequences, best first."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from pyengine.logprobs import Logprob


@dataclass
class BeamSearchSequence:
    """One finished beam.

    ``tokens`` holds the prompt's tokens then the generated ones (as vLLM's);
    ``logprobs`` one dict per generated token, token id -> ``Logprob`` (the candidates the
    engine returned for that step, the chosen token among them); ``cum_logprob`` the sum of the generated tokens'
    log-probabilities; ``score`` what the beams were ranked by (``cum_logprob /
    generated_len ** length_penalty``, transformers' ``sequences_scores``); ``text`` the
    generated text (without the end-of-sequence token unless
    ``include_stop_str_in_output``); ``finish_reason`` "stop" (an end-of-sequence token)
    or "length" (``max_tokens``), and ``stop_reason`` the end-of-sequence token id."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    score: float = 0.0
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (``tokens`` without the prompt)."""
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best (highest ``score``) first."""

    sequences: list[BeamSearchSequence]
    prompt: Optional[str] = None
    prompt_token_ids: list[int] = field(default_factory=list)
