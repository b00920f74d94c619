"""``TokenPieces``: each token id's text on its own, as log-probabilities show it.

vLLM fills ``Logprob.decoded_token`` with ``tokenizer.decode([id])`` (special tokens kept),
one id at a time, so a token that is half of a UTF-8 character reads as U+FFFD. Same
here, cached per id: a step's top-k and a prompt's tokens repeat ids, and the cache is
bounded by the vocabulary. Used by the output thread only.
"""

from __future__ import annotations

from typing import Any


class TokenPieces:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False) or ""
        return text
