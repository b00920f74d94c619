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


def event(chunk: BaseModel) -> bytes:
    """One SSE event carrying ``chunk`` as JSON."""
    return b"data: " + chunk.model_dump_json().encode() + b"\n\n"


def error_event(error: APIError) -> bytes:
    return b"data: " + json.dumps(error_body(error.message, error.type, error.param, error.code)).encode() + b"\n\n"


def sse_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    """A ``text/event-stream`` response. Starlette cancels ``events`` when the client
    disconnects; the generator's ``finally`` aborts its engine requests."""
    return StreamingResponse(events, media_type="text/event-stream", headers=_HEADERS)
