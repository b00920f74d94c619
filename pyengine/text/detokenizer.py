"""Incremental detokenization: one output sequence's token ids in, text deltas out.

Two strategies behind one class, chosen by the :class:`DecodeTable`:

- **Byte stream** (byte-level BPE, SentencePiece byte fallback): each id is looked up as
  bytes and fed to a streaming UTF-8 decoder, which holds back at most three bytes of an
  unfinished character. O(1) per token, and for byte-level BPE the deltas concatenate to
  exactly ``tokenizer.decode(output_ids, skip_special_tokens=...)``.
- **Window** (any other decoder): vLLM's prefix/read offsets. The new tokens are decoded
  together with the few tokens before them, and the text that the window adds is
  released once it does not end in U+FFFD. Two small decodes per step.
"""

from __future__ import annotations

import codecs
from typing import Sequence

from pyengine.text.decode_table import DecodeTable

__all__ = ["IncrementalDetokenizer"]

# Prompt tokens decoded as context ahead of the first output token (vLLM uses 5): enough
# for the decoder to see a word in progress and place leading spaces as in the full text.
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one output sequence's token ids into text, a step at a time.

    A character split across tokens (CJK, emoji) is held back until its last byte arrives,
    so no delta carries a U+FFFD that the full decode would not have. Call :meth:`flush`
    when the sequence ends to release what is still held back (an unfinished character
    comes out as U+FFFD, as the full decode writes it).

    Args:
        table: the tokenizer's :class:`DecodeTable` (build once, share across sequences).
        prompt_token_ids: the sequence's prompt; its last tokens are the context in which
            the first output tokens are decoded (which leading space survives). Byte-level
            decoding needs no context: the output's text is the decode of its ids alone.
        skip_special_tokens: leave special tokens out of the text (vLLM's default).
    """

    __slots__ = ("_strategy",)

    def __init__(
        self, table: DecodeTable, prompt_token_ids: Sequence[int], *, skip_special_tokens: bool = True
    ) -> None:
        token_bytes = table.bytes_for(skip_special_tokens)
        self._strategy: _ByteStream | _Window
        if token_bytes is not None:
            # SentencePiece's Strip drops the first space of the whole text: the output's own
            # first space when the prompt decodes to nothing (empty, or only skipped specials).
            strip = table.strips_leading_space and not any(
                _lookup(token_bytes, token_id) for token_id in prompt_token_ids
            )
            self._strategy = _ByteStream(token_bytes, strip_leading_space=strip)
        else:
            self._strategy = _Window(table, prompt_token_ids, skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append this step's token ids (>= 0; a list, tuple or numpy array); return the text
        they complete ("" if none yet). Ids past the tokenizer's vocabulary add no text."""
        return self._strategy.add(token_ids)

    def flush(self) -> str:
        """End of sequence: return the text still held back (U+FFFD for an unfinished character)."""
        return self._strategy.flush()


class _ByteStream:
    """Table lookup plus a streaming UTF-8 decoder; exact for byte-level BPE."""

    __slots__ = ("_token_bytes", "_utf8", "_strip_leading_space")

    def __init__(self, token_bytes: tuple[bytes, ...], *, strip_leading_space: bool) -> None:
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip_leading_space = strip_leading_space

    def add(self, token_ids: Sequence[int]) -> str:
        token_bytes = self._token_bytes
        try:
            if len(token_ids) == 1:
                data = token_bytes[token_ids[0]]
            else:
                data = b"".join([token_bytes[token_id] for token_id in token_ids])
        except IndexError:  # ids past the tokenizer's vocabulary (padded LM heads): no text
            data = b"".join([_lookup(token_bytes, token_id) for token_id in token_ids])
        if self._strip_leading_space and data:
            self._strip_leading_space = False
            if data[:1] == b" ":
                data = data[1:]
        return self._utf8.decode(data)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class _Window:
    """vLLM's prefix/read offsets over a bounded window of recent ids, for other decoders."""

    __slots__ = ("_tokenizer", "_skip_special_tokens", "_ids", "_read_offset")

    def __init__(
        self, table: DecodeTable, prompt_token_ids: Sequence[int], skip_special_tokens: bool
    ) -> None:
        self._tokenizer = table.tokenizer
        self._skip_special_tokens = skip_special_tokens
        # _ids[:_read_offset] is context whose text was already released (or is the prompt's);
        # _ids[_read_offset:] are ids whose text is still held back.
        self._ids: list[int] = [int(token_id) for token_id in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]]
        self._read_offset = len(self._ids)

    def add(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(int(token_id) for token_id in token_ids)
        context_text, window_text = self._decode_window()
        if window_text == context_text:
            # The new ids add no text at all (skipped special tokens): they become context,
            # and the window stays bounded however many of them arrive.
            self._read_offset = len(self._ids)
            if self._read_offset > PROMPT_CONTEXT_TOKENS:
                del self._ids[: self._read_offset - PROMPT_CONTEXT_TOKENS]
                self._read_offset = PROMPT_CONTEXT_TOKENS
            return ""
        if len(window_text) <= len(context_text) or window_text.endswith(_REPLACEMENT_CHAR):
            return ""  # a character still incomplete: wait for more ids
        # The released ids become the next step's context; older ids are dropped.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        return window_text[len(context_text) :]

    def flush(self) -> str:
        if self._read_offset == len(self._ids):
            return ""
        context_text, window_text = self._decode_window()
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        return window_text[len(context_text) :]

    def _decode_window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        context_text = decode(self._ids[: self._read_offset], skip_special_tokens=self._skip_special_tokens)
        window_text = decode(self._ids, skip_special_tokens=self._skip_special_tokens)
        return context_text, window_text


def _lookup(token_bytes: tuple[bytes, ...], token_id: int) -> bytes:
    """Bytes of ``token_id``; ``b""`` for ids the tokenizer does not know (as its decode does)."""
    return token_bytes[token_id] if 0 <= token_id < len(token_bytes) else b""
