"""``TokenPieces``: each token id's text on its own, cached per id (a step's top-k and a
prompt's tokens repeat ids; the cache is bounded by the vocabulary).

Two spellings, for the two places that show a lone token:

- ``piece(id)`` (or calling the object): vLLM's ``Logprob.decoded_token``,
  ``tokenizer.decode([id])`` with special tokens kept, so a token that is half of a UTF-8
  character reads as U+FFFD. The engine core's output thread uses it.
- ``text(id)`` / ``bytes(id)`` / ``text_length(id)``: what the OpenAI logprobs formats
  show, from the engine's byte table when there is one (exact bytes; a part of a
  character is spelled ``bytes:\\xe4\\xbd`` as OpenAI does), else from the tokenizer. The
  server uses them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional


class TokenPieces:
    def __init__(self, tokenizer: Optional[Any], token_bytes: Optional[Sequence[bytes]] = None) -> None:
        self.tokenizer = tokenizer
        self.table = token_bytes
        self._pieces: dict[int, str] = {}
        self._texts: dict[int, tuple[str, bytes]] = {}

    def piece(self, token_id: int) -> str:
        """``tokenizer.decode([token_id])``, special tokens kept ("" without a tokenizer)."""
        text = self._pieces.get(token_id)
        if text is None:
            decoded = self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer is not None else ""
            text = self._pieces[token_id] = decoded or ""
        return text

    __call__ = piece

    def _lookup(self, token_id: int) -> tuple[str, bytes]:
        hit = self._texts.get(token_id)
        if hit is not None:
            return hit
        if self.table is not None and 0 <= token_id < len(self.table):
            raw = self.table[token_id]
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:  # part of a character: spelled as OpenAI does
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        elif self.tokenizer is not None:
            text = self.piece(token_id)
            raw = text.encode("utf-8")
        else:
            text = f"token_id:{token_id}"
            raw = text.encode("utf-8")
        self._texts[token_id] = (text, raw)
        return text, raw

    def text(self, token_id: int) -> str:
        """The token's text; ``bytes:\\xe4\\xbd`` for a token that is part of a character."""
        return self._lookup(token_id)[0]

    def text_length(self, token_id: int) -> int:
        """How many characters the token adds to the text (0 for a part of a character)."""
        return len(self._lookup(token_id)[1].decode("utf-8", "ignore"))

    def bytes(self, token_id: int) -> list[int]:
        return list(self._lookup(token_id)[1])

    def decode(self, token_ids: list[int]) -> str:
        """Text of a whole sequence (e.g. a token-id prompt echoed back)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)
