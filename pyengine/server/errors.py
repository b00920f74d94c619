"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` and the
exception handlers that turn pyengine's and FastAPI's exceptions into them.

- malformed JSON / wrong types (pydantic) -> 400, ``param`` = the offending field
- ``InvalidRequestError`` (``SamplingParams`` errors are converted to it where they arise) -> 400
- anything else -> 500 ``server_error`` with a generic message: the exception goes to the
  server log under a reference the client sees, never into the body (it may name files,
  internals or another request's data)
- ``EngineDeadError`` -> 503
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Mapping
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pyengine.errors import EngineDeadError, InvalidRequestError

_KNOWN_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",  # OpenAI's type for model_not_found
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    503: "service_unavailable",
}
# SamplingParams names a field first in its messages: "max_tokens must be >= 1, got 0".
_LEADING_FIELD = re.compile(r"^([a-z_]+) ")
# Only these count as a field: other messages start with any word ("invalid request ...").
REQUEST_FIELDS = frozenset({
    "model", "prompt", "messages", "input", "n", "best_of", "temperature", "top_p", "top_k", "min_p", "stop",
    "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs",
    "top_logprobs", "max_tokens", "max_completion_tokens", "min_tokens", "ignore_eos", "stop_token_ids",
    "include_stop_str_in_output", "skip_special_tokens", "stream", "stream_options", "echo", "suffix",
    "encoding_format", "dimensions", "chat_template_kwargs", "allowed_token_ids", "bad_words", "prompt_logprobs",
    "truncate_prompt_tokens", "use_beam_search", "length_penalty", "early_stopping",
})
_log = logging.getLogger("pyengine.server.errors")


class APIError(Exception):
    """An error to return as an OpenAI error body with ``status``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type_: Optional[str] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _KNOWN_TYPES.get(status, "server_error")


def error_body(message: str, type_: str, param: Optional[str] = None, code: Optional[str] = None) -> dict[str, Any]:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error.message, error.type, error.param, error.code), status_code=error.status)


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param, code)


def from_value_error(error: ValueError, renames: Optional[Mapping[str, str]] = None) -> APIError:
    """A 400 for a ``ValueError`` from ``SamplingParams`` (or ``BeamSearchParams``) or the
    engine; ``param`` is the field the message starts with. ``renames`` maps our field
    names to the request's (``beam_width`` -> ``n``): a renamed field is the ``param`` and
    the message's first word."""
    message = str(error)
    match = _LEADING_FIELD.match(message)
    field = match.group(1) if match else None
    if field is not None and renames and field in renames:
        message, field = renames[field] + message[len(field):], renames[field]
        return bad_request(message, field)
    return bad_request(message, field if field in REQUEST_FIELDS else None)


def to_api_error(error: BaseException) -> APIError:
    """Maps any exception a handler lets through to the error to return."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineDeadError):
        return APIError(503, f"the engine cannot serve: {error}", code="engine_dead")
    if isinstance(error, InvalidRequestError):
        return from_value_error(error)
    # Anything else (a ValueError from inside the executor included) is the server's fault:
    # logged in full, answered with a reference and nothing of the exception.
    return internal_error(error)


def internal_error(error: BaseException) -> APIError:
    """A 500 that says nothing of ``error``; the log has it, under the same reference."""
    reference = uuid.uuid4().hex[:12]
    _log.error("internal error (reference %s)", reference, exc_info=(type(error), error, error.__traceback__))
    return APIError(500, f"internal server error (reference {reference})", type_="server_error")


def _param_of(loc: tuple[Any, ...]) -> Optional[str]:
    """The top-level request field of a pydantic error location
    (``("body", "messages", 0, "role")`` -> "messages")."""
    parts = [str(p) for p in loc if p != "body"]
    return parts[0] if parts else None


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves the server as an OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": "value_error"}
        if first.get("type") == "json_invalid":
            return error_response(bad_request(f"malformed JSON body: {first.get('msg')}", None, "json_invalid"))
        loc = tuple(first.get("loc", ()))
        param = _param_of(loc)
        where = ".".join(str(p) for p in loc if p != "body") or "body"
        message = f"{where}: {first.get('msg')}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more error(s))"
        return error_response(bad_request(message, param, str(first.get("type"))))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # A limit refused while the body was read carries its own error (``limits.py``).
        error = getattr(exc, "api_error", None) or APIError(exc.status_code, str(exc.detail))
        response = error_response(error)
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(to_api_error(exc))

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(to_api_error(exc))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_response(to_api_error(exc))
