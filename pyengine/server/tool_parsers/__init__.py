"""Tool-call parsers: plain Python over a choice's generated text, one file per format,
chosen by name with ``--tool-call-parser`` (vLLM's names).

- ``hermes``: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (Hermes 2 Pro,
  Qwen 2.5, Qwen 3);
- ``llama3_json``: ``{"name": ..., "parameters": ...}`` (Llama 3.1 / 3.2).

Each parser is a ``ToolCallStream`` (``base.py``): fed the text in pieces, it returns
content and tool-call pieces; ``parse_whole`` reads a whole answer with the same code."""

from __future__ import annotations

from types import MappingProxyType
from typing import Optional

from pyengine.server.tool_parsers.base import (
    ParsedCall,
    ParsedMessage,
    ParseStep,
    ToolCallChunk,
    ToolCallStream,
    parse_whole,
)
from pyengine.server.tool_parsers.hermes import HermesToolCallStream
from pyengine.server.tool_parsers.llama3_json import Llama3JsonToolCallStream

TOOL_PARSERS: MappingProxyType[str, type[ToolCallStream]] = MappingProxyType({
    "hermes": HermesToolCallStream,
    "llama3_json": Llama3JsonToolCallStream,
})


def tool_call_stream(name: str, max_calls: Optional[int] = None) -> ToolCallStream:
    """A new parser of the format ``name`` (a key of ``TOOL_PARSERS``)."""
    try:
        return TOOL_PARSERS[name](max_calls)
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(TOOL_PARSERS)}") from None


__all__ = ["TOOL_PARSERS", "tool_call_stream", "parse_whole", "ParseStep", "ParsedCall", "ParsedMessage",
           "ToolCallChunk", "ToolCallStream"]
