"""Long CPU work of one request (tokenizing a long prompt, rendering a long chat) in a
worker thread, so that the event loop goes on serving every other stream meanwhile.
Short inputs stay on the loop: a thread hop costs more than tokenizing a sentence."""

from __future__ import annotations

import asyncio
from typing import Any, Callable, TypeVar

from pyengine.text.encode import LONG_TEXT_CHARS

T = TypeVar("T")


def text_size(value: Any) -> int:
    """Characters of text in ``value`` (strings, and lists / dicts / objects with a
    ``text()`` of them: prompts, chat messages)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, int):
        return 0  # a token id: the common prompt of a benchmark is a list of them
    if isinstance(value, (list, tuple)):
        return sum(text_size(v) for v in value)
    if isinstance(value, dict):
        return sum(text_size(v) for v in value.values())
    text = getattr(value, "text", None)
    if callable(text):
        return text_size(text())
    return 0


async def off_the_loop_if_long(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, in a worker thread when ``size`` (characters) is long."""
    if size > LONG_TEXT_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)
