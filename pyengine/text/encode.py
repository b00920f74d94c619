"""Text to token ids without holding the GIL for long.

``tokenizers``' ``encode`` keeps the GIL for the whole call (a 300k-token text: 1.5 s in
which no other Python thread runs, an event loop included), ``encode_batch`` releases it.
Long texts go through the latter, so tokenizing one in a worker thread really lets the
server's event loop go on with the other streams."""

from __future__ import annotations

from typing import Any

#: Texts longer than this (characters) are tokenized with the GIL released, and the
#: server tokenizes them in a worker thread.
LONG_TEXT_CHARS = 8192


def encode_ids(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """``tokenizer.encode(text).ids``, the GIL released for a long text."""
    return list(encode(tokenizer, text, add_special_tokens).ids)


def encode(tokenizer: Any, text: str, add_special_tokens: bool = True) -> Any:
    """The ``Encoding`` of ``text``, the GIL released for a long text."""
    if len(text) > LONG_TEXT_CHARS:
        return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
