"""Token ids as the strings and bytes the OpenAI logprobs formats show."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional


class TokenText:
    """Per-token text and bytes, from the engine's byte table when it has one
    (exact bytes, even for a token that is half of a UTF-8 character), else from the
    tokenizer. Results are cached per id."""

    def __init__(self, tokenizer: Optional[Any], token_bytes: Optional[Sequence[bytes]]) -> None:
        self.tokenizer = tokenizer
        self.table = token_bytes
        self._cache: dict[int, tuple[str, bytes]] = {}

    def _lookup(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        if self.table is not None and 0 <= token_id < len(self.table):
            raw = self.table[token_id]
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:  # part of a character: spelled as OpenAI does
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        elif self.tokenizer is not None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            raw = text.encode("utf-8")
        else:
            text = f"token_id:{token_id}"
            raw = text.encode("utf-8")
        self._cache[token_id] = (text, raw)
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
