"""``ServerArgs``: the HTTP server's own settings (the engine's are ``EngineConfig``).

The resource limits and the docs switch are also ``pyengine serve`` flags, declared once
here (``LIMIT_FLAGS``) so that the CLI adds them with ``add_limit_flags`` and reads them
back with ``limit_kwargs`` instead of repeating every name and default."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Optional

from pyengine.errors import InvalidConfigError

LogFormat = Literal["console", "json"]
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's names


@dataclass(frozen=True, slots=True)
class ServerArgs:
    """Everything ``create_app`` needs besides the engine.

    - ``model_name``: the name clients send as ``model`` (and ``GET /v1/models`` lists);
      responses report it. ``model_aliases``: further names requests may use (vLLM's
      ``--served-model-name A B``), listed too.
    - ``chat_template``: a chat template's text that replaces the checkpoint's (the CLI
      reads ``--chat-template FILE_OR_STRING`` into it; ``template_choice.py`` decides).
    - ``api_key``: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>``.
    - ``max_n``: the largest ``n`` a request may ask for.
    - ``stall_timeout``: seconds without a finished step, while requests are pending,
      after which ``/health`` answers 503 and the watchdog dumps the engine threads.
    - ``watchdog_interval``: how often the watchdog looks (seconds).
    - ``stats_interval``: seconds between periodic engine-stats log lines (0 = never).
    - ``log_requests``: one log line per finished request.
    - ``uvicorn_log_level``: uvicorn's own loggers' level (None: ``log_level``).
    - ``drain_timeout``: on SIGTERM / SIGINT, seconds in-flight requests may still run
      before their streams are ended with an error event (0 = end them at once).

    Resource limits (each refusal is an OpenAI error body; see ``limits.py`` and
    ``http_protocol.py``):

    - ``max_body_bytes``: a larger request body is a 413, refused from its Content-Length
      before any of it is read, or as soon as a chunked body grows past it.
    - ``max_header_bytes``: a larger request head (request line and headers) is a 431.
    - ``header_timeout``: seconds for a request head to arrive in full (from the
      connection, or the end of the previous response); then 408 and the connection closes.
    - ``body_timeout``: seconds for a whole request body, once its head is in; then 408.
    - ``max_concurrent_requests``: ``/v1/*`` requests in progress at once (a stream counts
      until it ends); past it, 503 with ``Retry-After``.
    - ``max_prompts_per_request``: prompts in a completion, inputs of an embedding request
      (each one is an engine request). The default is OpenAI's limit on embedding inputs.
    - ``enable_docs``: serve ``/docs``, ``/redoc``, ``/openapi.json`` (off: they describe
      the server to anyone; on, they sit behind the API key like ``/v1/*``).

    Tool calling (``tools.py``; vLLM's flags):

    - ``tool_call_parser``: the format tool calls are parsed from (a name of
      ``pyengine.server.tool_parsers.TOOL_PARSERS``: ``hermes``, ``llama3_json``).
    - ``enable_auto_tool_choice``: serve ``tool_choice="auto"`` (needs ``tool_call_parser``);
      without it a request that offers tools with ``auto`` (the default) is a 400.

    The Responses API's store (``responses/store.py``):

    - ``responses_store_size``: responses kept for ``previous_response_id`` and
      ``GET /v1/responses/{id}``, least recently used evicted first (0: none kept).
    - ``responses_store_max_bytes``: what they may weigh together (the encoded JSON bytes held).
    """

    model_name: str = "pyengine"
    model_aliases: tuple[str, ...] = ()
    chat_template: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None
    max_n: int = 16
    stall_timeout: float = 30.0
    watchdog_interval: float = 1.0
    stats_interval: float = 10.0
    log_format: LogFormat = "console"
    log_level: str = "info"
    log_requests: bool = True
    uvicorn_log_level: Optional[str] = None
    drain_timeout: float = 30.0
    max_body_bytes: int = 16 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    max_concurrent_requests: int = 1024
    max_prompts_per_request: int = 2048
    enable_docs: bool = False
    tool_call_parser: Optional[str] = None
    enable_auto_tool_choice: bool = False
    responses_store_size: int = 1024
    responses_store_max_bytes: int = 256 * 1024 * 1024

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request may use, the reported one first."""
        return (self.model_name, *(a for a in self.model_aliases if a != self.model_name))

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_header_bytes", "max_concurrent_requests", "max_prompts_per_request"):
            if getattr(self, name) < 1:
                raise InvalidConfigError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("header_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("responses_store_size", "responses_store_max_bytes"):
            if getattr(self, name) < 0:
                raise InvalidConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.max_n < 1:
            raise InvalidConfigError(f"max_n must be >= 1, got {self.max_n!r}")
        if self.stall_timeout <= 0:
            raise InvalidConfigError(f"stall_timeout must be > 0, got {self.stall_timeout!r}")
        if self.watchdog_interval <= 0:
            raise InvalidConfigError(f"watchdog_interval must be > 0, got {self.watchdog_interval!r}")
        if self.stats_interval < 0:
            raise InvalidConfigError(f"stats_interval must be >= 0, got {self.stats_interval!r}")
        if not self.drain_timeout >= 0:
            raise InvalidConfigError(f"drain_timeout must be >= 0, got {self.drain_timeout!r}")
        if self.uvicorn_log_level is not None and self.uvicorn_log_level.lower() not in UVICORN_LOG_LEVELS:
            raise InvalidConfigError(f"uvicorn_log_level must be one of {', '.join(UVICORN_LOG_LEVELS)}, "
                                     f"got {self.uvicorn_log_level!r}")
        if self.log_format not in ("console", "json"):
            raise InvalidConfigError(f"log_format must be 'console' or 'json', got {self.log_format!r}")
        _check_tool_args(self)


def _check_tool_args(args: ServerArgs) -> None:
    from pyengine.server.tool_parsers import TOOL_PARSERS

    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_PARSERS:
        raise InvalidConfigError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, "
                                 f"got {args.tool_call_parser!r}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise InvalidConfigError("enable_auto_tool_choice needs tool_call_parser (--tool-call-parser): the format "
                                 "to parse tool calls from")


# (field, help) of the flags ``add_limit_flags`` adds; type and default come from ServerArgs.
LIMIT_FLAGS = (
    ("max_body_bytes", "largest request body in bytes (413 past it)"),
    ("max_header_bytes", "largest request head in bytes (431 past it)"),
    ("header_timeout", "seconds for a request head to arrive (408 past it)"),
    ("body_timeout", "seconds for a whole request body to arrive (408 past it)"),
    ("max_concurrent_requests", "/v1 requests in progress at once (503 + Retry-After past it)"),
    ("max_prompts_per_request", "prompts of a completion / inputs of an embedding request"),
    ("enable_docs", "serve /docs, /redoc and /openapi.json (behind the API key if one is set)"),
    ("responses_store_size", "responses kept for previous_response_id and GET /v1/responses/{id}, least "
     "recently used evicted first (0: none)"),
    ("responses_store_max_bytes", "what the kept responses may weigh together, in bytes of JSON"),
)


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """``--max-body-bytes`` ... ``--enable-docs``, defaults from ``ServerArgs``."""
    defaults = {f.name: f.default for f in dataclasses.fields(ServerArgs)}
    group = parser.add_argument_group("server limits")
    for name, text in LIMIT_FLAGS:
        flag, default = f"--{name.replace('_', '-')}", defaults[name]
        if isinstance(default, bool):
            group.add_argument(flag, dest=name, action="store_true", help=text)
        else:
            group.add_argument(flag, dest=name, type=type(default), default=default,
                               help=f"{text} (default: {default})")


def limit_kwargs(namespace: argparse.Namespace) -> dict[str, Any]:
    """The parsed limit flags, as ``ServerArgs`` keyword arguments."""
    return {name: getattr(namespace, name) for name, _ in LIMIT_FLAGS}


def add_tool_flags(parser: argparse.ArgumentParser) -> None:
    """``--tool-call-parser NAME`` and ``--enable-auto-tool-choice``, as vLLM spells them."""
    from pyengine.server.tool_parsers import TOOL_PARSERS

    group = parser.add_argument_group("tool calling")
    group.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                       help="the format tool calls are parsed from (hermes: Hermes / Qwen <tool_call> tags; "
                       "llama3_json: Llama 3 JSON)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='serve tool_choice="auto": tool calls parsed out of the text (needs --tool-call-parser)')


def tool_kwargs(namespace: argparse.Namespace) -> dict[str, Any]:
    return {"tool_call_parser": namespace.tool_call_parser,
            "enable_auto_tool_choice": namespace.enable_auto_tool_choice}
