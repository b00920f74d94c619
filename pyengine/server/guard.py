"""A plain ASGI middleware (no ``BaseHTTPMiddleware``, which gets in the way of streaming
and disconnect detection): the API key on ``/v1/*``, ``/tokenize``, ``/detokenize`` (and
on the docs, when they are served) and a count of error responses."""

from __future__ import annotations

import hmac
from typing import Any, Optional

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pyengine.server.errors import APIError, error_response

DOCS_PATHS = ("/docs", "/redoc", "/openapi.json")  # /docs/oauth2-redirect included
TOKENIZER_PATHS = ("/tokenize", "/detokenize")  # vLLM's; they run the chat template on a client's data


def needs_key(path: str) -> bool:
    return path.startswith("/v1/") or path.startswith(DOCS_PATHS) or path in TOKENIZER_PATHS


class GuardMiddleware:
    def __init__(self, app: ASGIApp, api_key: Optional[str], errors: Any, model_name: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key is not None else None
        self.errors = errors  # prometheus Counter labelled (model_name, status)
        self.model_name = model_name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.expected is not None and needs_key(scope["path"]):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                self.errors.labels(self.model_name, "401").inc()
                response = error_response(APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                                   code="invalid_api_key"))
                await response(scope, receive, send)
                return

        started = False

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 400:
                    self.errors.labels(self.model_name, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            # An unexpected exception is answered with a 500 by Starlette's outermost
            # middleware, past this one: count it here.
            if not started:
                self.errors.labels(self.model_name, "500").inc()
            raise
