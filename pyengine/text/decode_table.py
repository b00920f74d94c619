"""Per-tokenizer decoding tables: what bytes each token id contributes to the text.

A Hugging Face ``tokenizers.Tokenizer`` decodes a list of ids by mapping every id to its
token string, dropping special tokens when asked, and running the decoder chain over
the strings. For the two decoder chains that LLMs use, that chain is a per-token byte
mapping followed by one UTF-8 decode of the concatenated bytes:

- ``ByteLevel`` (GPT-2, Llama 3, Qwen2/3, Mistral Tekken): every character of a token
  stands for one byte (the GPT-2 byte-to-unicode table); a token holding a character
  outside that table (an added token such as ``"<end of turn>"``) is taken as its own
  UTF-8 text. The decoded text is ``bytes.decode("utf-8", "replace")`` of the joined
  bytes — exactly, including where U+FFFD replaces invalid bytes.
- SentencePiece with byte fallback (Llama 2, Mistral v0.1, Gemma): ``Replace("▁", " ")``,
  ``ByteFallback``, ``Fuse`` and optionally ``Strip(" ", 1, 0)``; ``<0xE4>``-style tokens
  are single bytes, others their text with ``▁`` as a space, and the optional strip drops
  one leading space of the whole text. Exact for valid UTF-8; where byte tokens spell
  invalid UTF-8, ``ByteFallback`` writes one U+FFFD per byte token of the run, this table
  one per invalid subsequence (the byte stream cannot know a run's end in advance).

Any other decoder (WordPiece, Metaspace without byte fallback, none) gets no table, and
:class:`~pyengine.text.detokenizer.IncrementalDetokenizer` falls back to decoding a
short window of recent tokens with the tokenizer itself.

A table is built once per tokenizer (a pass over the vocabulary: 0.3-0.5 s for
a 150k vocabulary) and shared, read-only, by every sequence's detokenizer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["DecodeTable"]

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SENTENCEPIECE_SPACE = "\u2581"


@dataclass(frozen=True, slots=True, eq=False)
class DecodeTable:
    """How one tokenizer turns token ids into text; shared by all of its sequences.

    Attributes:
        tokenizer: the tokenizer the table was built from (the fallback path decodes with it).
        token_bytes: bytes of every id, special tokens included; ``None`` when the decoder
            is not one of the byte-mapped chains (see the module docstring).
        token_bytes_skipping_special: the same with special tokens mapped to ``b""``.
        strips_leading_space: the decoder drops one leading space of the whole text
            (SentencePiece's ``Strip``), so a sequence whose context decodes to nothing
            loses its first space.
    """

    tokenizer: "Tokenizer" = field(repr=False)
    token_bytes: Optional[tuple[bytes, ...]] = field(repr=False)
    token_bytes_skipping_special: Optional[tuple[bytes, ...]] = field(repr=False)
    strips_leading_space: bool

    @classmethod
    def from_tokenizer(cls, tokenizer: "Tokenizer") -> "DecodeTable":
        """Build the table for ``tokenizer`` (byte-mapped when its decoder allows)."""
        decoder = json.loads(tokenizer.to_str()).get("decoder")
        piece_to_bytes, strips = _byte_mapping(decoder)
        if piece_to_bytes is None:
            return cls.window_only(tokenizer)
        added = tokenizer.get_added_tokens_decoder()
        special_contents = {token.content for token in added.values() if token.special}
        size = max([tokenizer.get_vocab_size(with_added_tokens=True), *(i + 1 for i in added)])
        with_special: list[bytes] = []
        without_special: list[bytes] = []
        for token_id in range(size):
            piece = tokenizer.id_to_token(token_id)
            data = b"" if piece is None else piece_to_bytes(piece)
            with_special.append(data)
            # tokenizers skips by content: any id whose string is a special token's.
            without_special.append(b"" if piece in special_contents else data)
        return cls(tokenizer, tuple(with_special), tuple(without_special), strips)

    @classmethod
    def window_only(cls, tokenizer: "Tokenizer") -> "DecodeTable":
        """A table without byte mapping: every sequence uses the window fallback (tests, benches)."""
        return cls(tokenizer, None, None, False)

    def __repr__(self) -> str:
        size = len(self.token_bytes) if self.token_bytes is not None else None
        return (
            f"DecodeTable(byte_mapped={self.is_byte_mapped}, ids={size}, "
            f"strips_leading_space={self.strips_leading_space})"
        )

    @property
    def is_byte_mapped(self) -> bool:
        """True when decoding is a table lookup plus a streaming UTF-8 decode."""
        return self.token_bytes is not None

    def bytes_for(self, skip_special_tokens: bool) -> Optional[tuple[bytes, ...]]:
        """The id -> bytes table to use for a sequence (``None``: no table, use the fallback)."""
        return self.token_bytes_skipping_special if skip_special_tokens else self.token_bytes


def _byte_mapping(decoder: Optional[dict[str, Any]]) -> tuple[Optional[Callable[[str], bytes]], bool]:
    """(token string -> bytes, strips one leading space) for a decoder's JSON, or (None, False)."""
    if decoder is None:
        return None, False
    if decoder.get("type") == "ByteLevel":
        return _byte_level_piece_decoder(), False
    if decoder.get("type") == "Sequence":
        steps = decoder.get("decoders", [])
        kinds = [step.get("type") for step in steps]
        if kinds[:3] != ["Replace", "ByteFallback", "Fuse"] or not _is_space_replace(steps[0]):
            return None, False
        if kinds[3:] == []:
            return _sentencepiece_piece_to_bytes, False
        if kinds[3:] == ["Strip"] and (
            steps[3].get("content"),
            steps[3].get("start"),
            steps[3].get("stop"),
        ) == (
            " ",
            1,
            0,
        ):
            return _sentencepiece_piece_to_bytes, True
    return None, False


def _is_space_replace(step: dict[str, Any]) -> bool:
    return step.get("pattern") == {"String": _SENTENCEPIECE_SPACE} and step.get("content") == " "


def _byte_level_piece_decoder() -> Callable[[str], bytes]:
    """The ByteLevel decoder for one token: mapped bytes, or the token's UTF-8 if unmappable."""
    char_to_byte = _byte_level_char_to_byte()

    def piece_to_bytes(piece: str) -> bytes:
        try:
            return bytes([char_to_byte[char] for char in piece])
        except KeyError:
            return piece.encode("utf-8")

    return piece_to_bytes


def _byte_level_char_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode``: printable bytes map to themselves, the rest
    to U+0100 onwards in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    char_to_byte = {chr(byte): byte for byte in printable}
    unprintable = [byte for byte in range(256) if chr(byte) not in char_to_byte]
    for offset, byte in enumerate(unprintable):
        char_to_byte[chr(256 + offset)] = byte
    return char_to_byte


def _sentencepiece_piece_to_bytes(piece: str) -> bytes:
    """``<0xE4>`` -> one byte; anything else its text with ``▁`` read as a space."""
    byte_token = _BYTE_TOKEN.fullmatch(piece)
    if byte_token is not None:
        return bytes([int(byte_token.group(1), 16)])
    return piece.replace(_SENTENCEPIECE_SPACE, " ").encode("utf-8")
