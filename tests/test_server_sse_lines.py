"""Every SSE event is one line for readers that split on all Unicode line breaks.

Generated text may hold U+2028, U+2029 or U+0085, which JSON allows raw inside strings
but ``str.splitlines`` (httpx's ``iter_lines``) treats as line breaks, cutting an event in
two. The server escapes them; the JSON decodes to the same text.
"""

from __future__ import annotations

import json

import pytest
from httpx._decoders import LineDecoder
from pydantic import BaseModel

from pyengine.server.errors import APIError
from pyengine.server.sse import error_event, event


class _Chunk(BaseModel):
    text: str


@pytest.mark.parametrize("text", ["a\u2028b", "a\u2029b", "a\x85b", "é\u2028\u2029\x85ü", "plain"])
def test_an_event_with_unicode_line_breaks_stays_one_line(text: str) -> None:
    raw = event(_Chunk(text=text)).decode()
    lines = [line for line in LineDecoder().decode(raw) if line]
    assert len(lines) == 1
    assert lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: "):]) == {"text": text}


def test_an_error_event_with_a_line_break_character_stays_one_line() -> None:
    raw = error_event(APIError(400, "bad \u2028 input")).decode()
    lines = [line for line in LineDecoder().decode(raw) if line]
    assert len(lines) == 1
    assert json.loads(lines[0][len("data: "):])["error"]["message"] == "bad \u2028 input"
