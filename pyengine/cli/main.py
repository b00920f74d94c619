"""Command line: ``pyengine generate`` (the default), ``pyengine simulate``, ``pyengine serve``;
``pyengine --help`` lists them, ``pyengine --version``.

Also ``python -m pyengine ...`` where the installed package is the one imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def _generate(argv: list[str]) -> int:
    from pyengine.cli.generate import main as generate_main

    return generate_main(argv)


def _simulate(argv: list[str]) -> int:
    from pyengine.devtools.simulate import SimulationConfig, report, run

    parser = argparse.ArgumentParser(prog="pyengine simulate",
                                     description="the scheduler thread on a random workload, fake executor")
    for f in dataclasses.fields(SimulationConfig):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    stats = run(SimulationConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SimulationConfig)}))
    print(json.dumps(stats) if args.json else report(stats))
    return 0


def _core(argv: list[str]) -> int:
    from pyengine.multiprocess.core_main import main as core_main

    return core_main(argv)


def _serve(argv: list[str]) -> int:
    from pyengine.server.cli import main as serve_main

    return serve_main(argv)


COMMANDS = {"generate": _generate, "simulate": _simulate, "serve": _serve, "core": _core}
SUMMARIES = {
    "generate": "batch generation: prompts from flags, a file or stdin (text or JSONL), results as JSONL",
    "serve": "an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)",
    "simulate": "the scheduler thread on a random workload with a fake executor",
    "core": "an engine-core process serving a `pyengine serve` front end on another host (tcp://)",
}


def _usage() -> str:
    lines = [
        "usage: pyengine [--version] [--help] {generate,serve,simulate,core} [options]",
        "",
        "commands (without one, options go to `generate`):",
        *(f"  {name:<10} {summary}" for name, summary in SUMMARIES.items()),
        "",
        "`pyengine COMMAND --help` lists a command's options. MODEL is a Hugging Face checkpoint",
        "folder or a hub id (ORG/NAME, resolved through huggingface_hub and its cache).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Runs a subcommand; an engine error (unsupported model, bad argument, unreadable
    checkpoint) is one line ``pyengine: ...`` on stderr and exit status 2, not a traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv and argv[0] in ("-V", "--version"):
        from pyengine import __version__

        print(f"pyengine {__version__}")
        return 0
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        print(f"pyengine: unknown command {argv[0]!r} (commands: {', '.join(COMMANDS)}; "
              "see pyengine --help)", file=sys.stderr)
        return 2
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "generate"
    from pyengine.errors import EngineDeadError, EngineError

    try:
        return COMMANDS[command](argv)
    except EngineDeadError:
        raise  # a crash inside the engine: its traceback is what a bug report needs
    except EngineError as error:
        print(f"pyengine {command}: {error}", file=sys.stderr)
        return 2


def run() -> None:
    """The console script and ``python -m pyengine``: runs ``main`` and exits with its status.

    ``pyengine serve`` leaves through ``os._exit`` once ``main`` returned (the server
    stopped, the engine shut down: its threads joined, its processes reaped, the log
    listener stopped), after flushing the logs and the standard streams, as the engine-core
    and tensor-parallel worker processes do. The interpreter's teardown would only unload
    torch and what it imported; triton's bindings (imported through transformers and
    ``torch._dynamo`` in a process that runs the engine) print a 30-line "nanobind: leaked
    ..." report there. While another non-daemon thread still runs, the ordinary exit,
    which waits for it, is kept."""
    argv = sys.argv[1:]
    code = main(argv)
    if argv[:1] == ["serve"] and not _other_threads_running():
        import logging
        import os

        from pyengine.multiprocess.watchdog import flush_standard_streams

        try:
            logging.shutdown()
        finally:
            flush_standard_streams()
            os._exit(code)
    sys.exit(code)


def _other_threads_running() -> bool:
    import threading

    return any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread())

