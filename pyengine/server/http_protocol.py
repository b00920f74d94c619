"""Limits on the request head, which no ASGI middleware can enforce: the app is called
only once the head is complete, and uvicorn's httptools protocol (the one it picks when
httptools is installed) neither bounds a head's size nor times out a slow one.

``limited_protocol(args)`` is uvicorn's own protocol class with two checks around
``data_received``, made before bytes reach the parser:

- **size**: bytes of the head so far (up to its blank line) above ``max_header_bytes``
  are a 431, refused before the parser buffers them;
- **time**: a head not complete ``header_timeout`` seconds after the connection opened
  (or after the previous request and its response are both complete) is a 408 (or a
  silent close when nothing was sent).

A response can be complete before its request's body has arrived (a 401, a 404, a 503
sent without reading the body); the rest of that body is not the next head, so counting
restarts only once both are done.

Both answer in the OpenAI error format and close the connection. ``uvicorn_options(args)``
is what ``uvicorn.Config`` needs for them (the CLI and the test server use it).
"""

from __future__ import annotations

import asyncio
import json
import re
from http import HTTPStatus
from typing import Any, Optional

from pyengine.server.args import ServerArgs
from pyengine.server.errors import APIError, error_body

_HEAD_END = re.compile(rb"\r?\n\r?\n")


def _base_protocol() -> type:
    try:
        import httptools  # noqa: F401
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:  # pragma: no cover - h11 only
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base
    return Base


def limited_protocol(args: ServerArgs) -> type:
    """uvicorn's HTTP/1.1 protocol with ``args``' head size and time limits."""
    base = _base_protocol()
    max_head, head_timeout = args.max_header_bytes, args.header_timeout

    class LimitedHTTPProtocol(base):  # type: ignore[valid-type, misc]
        _head_timer: Optional[asyncio.TimerHandle] = None
        _head_cycle: Any = None
        _head_bytes = 0
        _tail = b""
        _refused = False
        _message_done = True  # the current request has been received whole (httptools base)
        _arm_when_received = False

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            self._message_done = False
            super().on_message_begin()

        def on_message_complete(self) -> None:
            self._message_done = True
            super().on_message_complete()
            if self._arm_when_received and not self.transport.is_closing():
                self._arm_when_received = False
                self._arm()  # the response went first; now the next head may start

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._disarm()
            if self.transport.is_closing():
                return
            if self._message_done:
                self._arm()  # the next request's head on this connection
            else:
                self._arm_when_received = True  # the rest of this body is still to come

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._head_timer is not None:
                window = self._tail + data
                end = _HEAD_END.search(window)
                head_size = self._head_bytes + (end.end() - len(self._tail) if end else len(data))
                if head_size > max_head:
                    self._refuse(APIError(431, f"the request head exceeds the limit of {max_head} bytes",
                                          code="headers_too_large"))
                    return
                self._head_bytes += len(data)
                self._tail = window[-3:]
            super().data_received(data)
            if self._head_timer is not None and self.cycle is not self._head_cycle:
                self._disarm()  # the head is complete: the body's limits are the app's

        def _arm(self) -> None:
            self._head_cycle, self._head_bytes, self._tail = self.cycle, 0, b""
            self._head_timer = self.loop.call_later(head_timeout, self._head_expired)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_expired(self) -> None:
            self._head_timer = None
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a request is being served (a pipelined one took over)
            if self._head_bytes == 0:
                self.transport.close()  # an idle connection: nothing to answer
                return
            self._refuse(APIError(408, f"the request head did not arrive within {head_timeout:g} s",
                                  code="header_timeout"))

        def _refuse(self, error: APIError) -> None:
            self._refused = True
            self._disarm()
            body = json.dumps(error_body(error.message, error.type, error.param, error.code)).encode()
            head = (f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\n"
                    f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
                    "connection: close\r\n\r\n").encode()
            if not self.transport.is_closing():
                self.transport.write(head + body)
                self.transport.close()

    return LimitedHTTPProtocol


def uvicorn_options(args: ServerArgs) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config``: the limited protocol, and h11's own bound
    on an incomplete event (used if h11 is the base) set to the same size."""
    return {"http": limited_protocol(args), "h11_max_incomplete_event_size": args.max_header_bytes}
