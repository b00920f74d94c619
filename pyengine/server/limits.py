"""``LimitsMiddleware``: what a request may take from the server once its head is in.

- **Concurrency.** ``/v1/*`` requests in progress (a stream until its last byte) are
  counted; past ``max_concurrent_requests`` a request gets 503 with ``Retry-After`` at
  once, before its body is read. Health and metrics are never refused: an overloaded
  server must still say so.
- **Body size.** A ``Content-Length`` above ``max_body_bytes`` is a 413 before any of the
  body is read; a chunked body is counted as it arrives and refused as soon as it passes
  the limit. Nothing is buffered past the limit (uvicorn itself pauses reading while the
  app does not consume).
- **Body time.** The whole body must arrive within ``body_timeout`` seconds of the head;
  a client trickling bytes gets a 408. After the body, ``receive`` is passed through
  untouched: it then waits for a disconnect, which may take as long as a stream lasts.

Refusals mid-body are raised from ``receive`` as ``HTTPException``s (FastAPI re-raises
those from its body parsing) carrying the ``APIError`` to answer; they close the
connection, whose unread rest would otherwise be parsed as the next request. The request
head's own limits (size, time) are in ``http_protocol.py``: no ASGI app sees a head
before it is complete.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pyengine.server.args import ServerArgs
from pyengine.server.errors import APIError, error_response

CLOSE = {"connection": "close"}


class LimitRefusal(HTTPException):
    """A limit hit while the app reads the body: the error to answer, connection closed."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.status, error.message, headers=dict(CLOSE))
        self.api_error = error


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds the limit of {limit} bytes", code="request_too_large")


class LimitsMiddleware:
    def __init__(self, app: ASGIApp, args: ServerArgs) -> None:
        self.app = app
        self.args = args
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refuse_early(scope)
        if refusal is not None:
            await self._answer(refusal, scope, receive, send)
            return
        counted = scope["path"].startswith("/v1/")
        if counted:
            self.in_flight += 1
        try:
            await self.app(scope, self._limited(receive), send)
        finally:
            if counted:
                self.in_flight -= 1

    def _refuse_early(self, scope: Scope) -> Optional[APIError]:
        if scope["path"].startswith("/v1/") and self.in_flight >= self.args.max_concurrent_requests:
            return APIError(503, f"the server is at its limit of {self.args.max_concurrent_requests} concurrent "
                            "requests; retry shortly", code="server_overloaded")
        for name, value in scope["headers"]:
            if name == b"content-length":
                if not value.strip().isdigit():
                    return APIError(400, "invalid Content-Length header", code="invalid_content_length")
                if int(value) > self.args.max_body_bytes:
                    return too_large(self.args.max_body_bytes)
        return None

    async def _answer(self, error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(error)
        if error.status == 503:
            response.headers["retry-after"] = "1"
        else:
            response.headers.update(CLOSE)  # the body was not read: this connection is done
        await response(scope, receive, send)

    def _limited(self, receive: Receive) -> Receive:
        """``receive`` with the body's size and time limits, until the body is complete."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.args.body_timeout
        limit = self.args.max_body_bytes
        received = 0
        body_done = False

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise LimitRefusal(APIError(408, f"the request body did not arrive within "
                                                 f"{self.args.body_timeout:g} s", code="body_timeout")) from None
            if message["type"] != "http.request":
                body_done = True  # a disconnect: nothing more will come
                return message
            received += len(message.get("body", b""))
            if received > limit:
                raise LimitRefusal(too_large(limit))
            body_done = not message.get("more_body", False)
            return message

        return limited_receive
