"""``pyengine serve [MODEL] [--host H] [--port P] [server options] [engine args]``.

Engine arguments are ``EngineConfig``'s fields spelled as flags (``--max-num-seqs 64``,
``--pipeline-depth 1``, ``--dtype bfloat16``, ``--no-enable-prefix-caching``...), added by
``pyengine.cli.engine_flags`` as for ``pyengine core`` and ``pyengine generate``.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading
import time
from typing import Any, Optional

from pyengine.cli.engine_flags import add_engine_flags, engine_kwargs
from pyengine.config import EngineConfig
from pyengine.inputs.chat_template import load_chat_template
from pyengine.multiprocess.link_options import add_link_flags, link_options
from pyengine.server.args import (
    UVICORN_LOG_LEVELS,
    ServerArgs,
    add_limit_flags,
    add_tool_flags,
    limit_kwargs,
    tool_kwargs,
)


def build_parser() -> tuple[argparse.ArgumentParser, list[str]]:
    parser = argparse.ArgumentParser(prog="pyengine serve", description="OpenAI-compatible HTTP server")
    default = {f.name: f.default for f in dataclasses.fields(ServerArgs)}  # one source of truth
    parser.add_argument("model", nargs="?", default=None,
                        help="Hugging Face checkpoint folder (default: the built-in tiny model)")
    parser.add_argument("--host", default=default["host"])
    parser.add_argument("--port", type=int, default=default["port"])
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the model name(s) clients send; responses report the first (default: the model "
                        "argument as given, as vLLM does)")
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_STRING",
                        help="a chat template (a file's path, or the jinja2 text itself) used instead of the "
                        "checkpoint's chat_template.jinja / tokenizer_config.json one")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    parser.add_argument("--max-n", type=int, default=default["max_n"], help="largest n a request may ask for")
    parser.add_argument("--stall-timeout", type=float, default=default["stall_timeout"],
                        help="seconds without a finished step (requests pending) before /health is 503")
    parser.add_argument("--watchdog-interval", type=float, default=default["watchdog_interval"])
    parser.add_argument("--stats-interval", type=float, default=default["stats_interval"],
                        help="seconds between engine-stats log lines (0: none)")
    parser.add_argument("--log-format", choices=["console", "json"], default=default["log_format"])
    parser.add_argument("--log-level", default=default["log_level"])
    parser.add_argument("--uvicorn-log-level", default=None, choices=UVICORN_LOG_LEVELS,
                        help="level of uvicorn's own loggers (default: --log-level)")
    requests = parser.add_mutually_exclusive_group()
    requests.add_argument("--no-log-requests", "--disable-log-requests", dest="no_log_requests",
                          action="store_true", help="no log line per finished request")
    requests.add_argument("--enable-log-requests", dest="no_log_requests", action="store_false",
                          help="a log line per finished request (the default; vLLM's spelling)")
    parser.set_defaults(no_log_requests=not default["log_requests"])
    parser.add_argument("--drain-timeout", type=float, default=default["drain_timeout"],
                        help="on SIGTERM / SIGINT, seconds in-flight requests may still run before their "
                        "streams are ended with an error event (0: at once; a second signal also ends them)")
    add_limit_flags(parser)  # --max-body-bytes ... --enable-docs, defaults from ServerArgs
    add_tool_flags(parser)  # --tool-call-parser, --enable-auto-tool-choice
    parser.add_argument("--multiprocess", action=argparse.BooleanOptionalAction, default=True,
                        help="run the engine core(s) in processes of their own, the HTTP front end in this one "
                        "(the default); --no-multiprocess keeps the engine in the server's process")
    add_link_flags(parser)  # --engine-transport ...: LinkOptions's fields
    return parser, add_engine_flags(parser)


def parse(argv: list[str]) -> tuple[Optional[str], dict[str, Any], ServerArgs]:
    """(model, engine kwargs, server args) from the command line."""
    return _parse(argv)[:3]


def _parse(argv: list[str]) -> tuple[Optional[str], dict[str, Any], ServerArgs, argparse.Namespace]:
    parser, engine_names = build_parser()
    ns = parser.parse_args(argv)
    # vLLM's default: the model argument as given (a hub id stays "org/name").
    names = ns.served_model_name or [ns.model if ns.model else "pyengine-tiny"]
    chat_template = load_chat_template(ns.chat_template) if ns.chat_template is not None else None
    args = ServerArgs(model_name=names[0], model_aliases=tuple(names[1:]), chat_template=chat_template,
                      uvicorn_log_level=ns.uvicorn_log_level, host=ns.host, port=ns.port, api_key=ns.api_key, max_n=ns.max_n,
                      stall_timeout=ns.stall_timeout, watchdog_interval=ns.watchdog_interval,
                      stats_interval=ns.stats_interval, log_format=ns.log_format, log_level=ns.log_level,
                      log_requests=not ns.no_log_requests, drain_timeout=ns.drain_timeout, **limit_kwargs(ns),
                      **tool_kwargs(ns))
    return ns.model, engine_kwargs(ns, engine_names), args, ns


def uvicorn_log_level(args: ServerArgs) -> str:
    """uvicorn's loggers' level: ``--uvicorn-log-level``, else ``--log-level``."""
    return (args.uvicorn_log_level or args.log_level).lower()


class _StartSignals:
    """The start-up's SIGINT / SIGTERM handler: records the signal and sets ``abandon``
    (which ``MultiprocessEngine``'s wait for its cores polls). It never raises: an
    exception at an arbitrary line could leave a built engine unreferenced, never shut down."""

    def __init__(self) -> None:
        self.abandon = threading.Event()
        self.signum: Optional[int] = None

    def __call__(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum
        self.abandon.set()


def main(argv: list[str]) -> int:
    """Builds the engine, serves until SIGTERM / SIGINT, drains (``pyengine.server.drain``),
    then shuts the engine down and flushes the logs: exit status 0."""
    try:
        model, engine_kwargs, args, ns = _parse(argv)
        config = EngineConfig.from_kwargs(model, **engine_kwargs)
        link = link_options(ns) if ns.multiprocess else None
    except ValueError as error:
        print(f"pyengine serve: {error}", file=sys.stderr)
        return 2
    import uvicorn

    from pyengine.entrypoints.client_factory import make_engine_client
    from pyengine.processes.startup_heap import freeze_startup_heap
    from pyengine.server.app import create_app
    from pyengine.server.drain import BACKSTOP_S, Drain, DrainingServer, DrainMiddleware
    from pyengine.server.http_protocol import uvicorn_options
    from pyengine.server.logs import configure_logging, get_logger

    listener = configure_logging(args.log_format, args.log_level)
    logger = get_logger(model=args.model_name)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        start_signals = _StartSignals()
        if ns.multiprocess:
            # A signal while the cores start ends the start-up: the engine's constructor
            # kills and reaps what it started, and the command exits 128 + the signal.
            for sig in previous:
                signal.signal(sig, start_signals)
        # The engine core(s) in their own processes (multiprocess, the default): their
        # start-up or load failure raises here, and the command exits with its message.
        try:
            engine = make_engine_client(config, multiprocess=ns.multiprocess, link=link,
                                        abandon=start_signals.abandon if ns.multiprocess else None)
        except BaseException:
            if start_signals.signum is not None:
                logger.info("start-up abandoned", signal=signal.Signals(start_signals.signum).name)
                return 128 + start_signals.signum
            raise
        # From here on a late signal (during the cleanup below, after uvicorn has put
        # these handlers back) must not interrupt the engine's shutdown half-way.
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)
        if start_signals.signum is not None:  # it came once the cores were ready: nothing is served
            logger.info("start-up abandoned", signal=signal.Signals(start_signals.signum).name)
            engine.shutdown()
            return 128 + start_signals.signum
        try:
            drain = Drain(args.drain_timeout, logger)
            app = DrainMiddleware(create_app(engine, args), drain)
            server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_config=None,
                                                   log_level=uvicorn_log_level(args),
                                                   timeout_graceful_shutdown=args.drain_timeout + BACKSTOP_S,
                                                   **uvicorn_options(args)),
                                    drain)
            freeze_startup_heap()  # this process serves until it stops: no full GC pass walks start-up's objects
            server.run()
            logger.info("server stopped", requests_ended_by_drain=drain.cut)
        finally:
            started = time.monotonic()
            engine.shutdown()
            logger.info("engine shut down", seconds=round(time.monotonic() - started, 3))
    finally:
        # Every path, a failed start-up included, gives the caller its own handlers back
        # (main() also runs inside other programs, e.g. tests).
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        listener.stop()
    return 0
