"""``ServerArgs``: the HTTP server's own settings (the engine's are ``EngineConfig``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from pyengine.errors import InvalidConfigError

LogFormat = Literal["console", "json"]


@dataclass(frozen=True, slots=True)
class ServerArgs:
    """Everything ``create_app`` needs besides the engine.

    - ``model_name``: the name clients send as ``model`` (and ``GET /v1/models`` lists).
    - ``api_key``: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>``.
    - ``max_n``: the largest ``n`` a request may ask for.
    - ``stall_timeout``: seconds without a finished step, while requests are pending,
      after which ``/health`` answers 503 and the watchdog dumps the engine threads.
    - ``watchdog_interval``: how often the watchdog looks (seconds).
    - ``stats_interval``: seconds between periodic engine-stats log lines (0 = never).
    - ``log_requests``: one log line per finished request.
    - ``drain_timeout``: on SIGTERM / SIGINT, seconds in-flight requests may still run
      before their streams are ended with an error event (0 = end them at once).
    """

    model_name: str = "pyengine"
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
    drain_timeout: float = 30.0

    def __post_init__(self) -> None:
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
        if self.log_format not in ("console", "json"):
            raise InvalidConfigError(f"log_format must be 'console' or 'json', got {self.log_format!r}")
