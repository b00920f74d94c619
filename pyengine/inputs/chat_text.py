"""A chat's token ids in which only the template makes control tokens (used by
``chat_template.render_chat``, for ``LLM.chat`` and the server alike).

The template writes its turn markers (``<|im_start|>system``...) as text, so the rendered
prompt has to be tokenized with special tokens parsed. Tokenizing it whole, as
``apply_chat_template`` does, also parses the ones a user typed: a message saying
``<|im_end|><|im_start|>system`` would forge a turn. So before rendering, every special
token's text inside client-supplied strings (content, names, template kwargs) is swapped
for a placeholder carrying a per-request random nonce; the rendered text is split at the
placeholders; the template's pieces are tokenized with special tokens parsed, and each
typed token's text with ``encode_special_tokens`` (a second tokenizer, so the shared one
is never flipped while another thread uses it), which spells it as ordinary text tokens.

Why placeholders and not "render with markers around all user text": templates look at
content (``content.split('</think>')``, ``| trim``); a placeholder changes content only
where a special token's text was typed, so ordinary chats render exactly as before.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from pyengine.errors import InvalidRequestError
from pyengine.text.encode import encode


class ChatTokenizer:
    """Tokenizes rendered chats; user-typed special tokens stay text."""

    def __init__(self, tokenizer: Any) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = tokenizer
        specials = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special and t.content}
        # Longest first, so that a token containing another is matched whole.
        self._special = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))) \
            if specials else None
        self._literal = Tokenizer.from_str(tokenizer.to_str())
        self._literal.encode_special_tokens = True

    def session(self) -> ChatEscapes:
        """The escaper of one request (its own nonce and placeholders)."""
        return ChatEscapes(self)


class ChatEscapes:
    """One request's placeholders: ``escape`` the client's values, render, ``encode``."""

    def __init__(self, owner: ChatTokenizer) -> None:
        self.owner = owner
        nonce = secrets.token_hex(8)
        self._open = f"\ue000{nonce}:"
        self._split = re.compile(re.escape(self._open) + r"(\d+)\ue001")
        self.typed: list[str] = []  # the special tokens' text, by placeholder number

    def _placeholder(self, match: re.Match[str]) -> str:
        self.typed.append(match.group(0))
        return f"{self._open}{len(self.typed) - 1}\ue001"

    def escape(self, value: Any) -> Any:
        """``value`` (a string, or lists / dicts of them) with special tokens' text
        replaced by placeholders; other values unchanged."""
        if self.owner._special is None:
            return value
        if isinstance(value, str):
            return self.owner._special.sub(self._placeholder, value)
        if isinstance(value, list):
            return [self.escape(v) for v in value]
        if isinstance(value, dict):
            return {k: self.escape(v) for k, v in value.items()}
        return value

    def encode(self, rendered: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of the rendered chat: template text with its special tokens, typed
        special tokens as plain text. ``add_special_tokens``: also what the tokenizer's
        post-processor adds around a text (a BOS...), as ``add_special_tokens=True`` on
        the whole chat would; off by default, since templates write their own."""
        try:
            rendered.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError("messages render to text that is not valid Unicode (a lone surrogate)") \
                from None
        encodings = []
        pieces = self._split.split(rendered)
        # split() alternates: text, placeholder number, text, ...
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                if piece:
                    encodings.append(encode(self.owner.tokenizer, piece, add_special_tokens=False))
            else:
                encodings.append(self.owner._literal.encode(self.typed[int(piece)], add_special_tokens=False))
        if add_special_tokens:
            from tokenizers import Encoding

            return list(self.owner.tokenizer.post_process(Encoding.merge(encodings, growing_offsets=True)).ids)
        return [token for encoding in encodings for token in encoding.ids]

    def restore(self, rendered: str) -> str:
        """The rendered chat with each placeholder back to the text the caller typed."""
        return self._split.sub(lambda match: self.typed[int(match.group(1))], rendered)
