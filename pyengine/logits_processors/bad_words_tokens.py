"""bad_words -> token sequences, as vLLM tokenizes them.

Each word is tokenized without special tokens, once as written (leading spaces
stripped) and once with one leading space, so that it is caught both at the start of
the text and after a space. The spaced form is kept only when it is a different word
token of the same length (its first token differs), as vLLM does.
"""

from __future__ import annotations

from typing import Any

from pyengine.errors import InvalidRequestError
from pyengine.text.encode import encode_ids


def bad_words_token_ids(tokenizer: Any, words: list[str], vocab_size: int) -> list[list[int]]:
    """The token sequences to forbid; ``InvalidRequestError`` naming ``bad_words`` when a
    word tokenizes to nothing or to ids outside the model's vocabulary."""
    sequences: list[list[int]] = []
    for word in words:
        plain = encode_ids(tokenizer, word.lstrip(), add_special_tokens=False)
        if not plain:
            raise InvalidRequestError(f"bad_words: {word!r} tokenizes to no tokens")
        sequences.append(plain)
        spaced = encode_ids(tokenizer, " " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    outside = [t for sequence in sequences for t in sequence if t >= vocab_size]
    if outside:
        raise InvalidRequestError(
            f"bad_words tokenize to id {outside[0]}, outside the model's vocabulary (size {vocab_size})"
        )
    return sequences
