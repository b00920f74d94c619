"""Server-sent events in the OpenAI streaming format: ``data: {json}\\n\\n`` per chunk and
``data: [DONE]\\n\\n`` at the end; a failure mid-stream is an error chunk, then [DONE]."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from pyengine.server.errors import APIError, error_body

DONE = b"data: [DONE]\n\n"
_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


#: Characters JSON may carry raw inside strings that line readers built on
#: ``str.splitlines`` (httpx's ``iter_lines``, many scripts) take for line breaks, which would
#: cut an event in two. Escaped, the JSON means the same and every event is one line.
_LINE_BREAKS_IN_JSON = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def event(chunk: BaseModel) -> bytes:
    """One SSE event carrying ``chunk`` as JSON."""
    return _data_line(chunk.model_dump_json())


def error_event(error: APIError) -> bytes:
    return _data_line(json.dumps(error_body(error.message, error.type, error.param, error.code)))


def typed_event(name: str, data: dict) -> bytes:
    """One SSE event with an ``event:`` line naming its type, as the Responses API streams
    (``event: response.output_text.delta``), carrying ``data`` as JSON."""
    return b"event: " + name.encode() + b"\n" + _data_line(json.dumps(data))


def _data_line(text: str) -> bytes:
    if not text.isascii():
        text = text.translate(_LINE_BREAKS_IN_JSON)
    return b"data: " + text.encode() + b"\n\n"


def sse_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    """A ``text/event-stream`` response. Starlette cancels ``events`` when the client
    disconnects; the generator's ``finally`` aborts its engine requests."""
    return StreamingResponse(events, media_type="text/event-stream", headers=_HEADERS)
