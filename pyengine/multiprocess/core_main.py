"""``pyengine core``: an engine-core process, started by a front end on this host or by
hand on another one (``docs/multiprocess.md``).

The front end starts its local cores with ``--config-json`` (its already validated
``EngineConfig``) and ``--parent-pid``; a core on another host takes the model and the
engine arguments as ``pyengine serve`` does, and ``--input`` / ``--output`` naming the
front end's tcp:// addresses. ``--cpus`` pins the process (and its torch threads) to a
share of the CPUs, before torch is imported.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from typing import Any, Optional


def build_parser() -> tuple[argparse.ArgumentParser, list[str]]:
    from pyengine.cli.engine_flags import add_engine_flags

    parser = argparse.ArgumentParser(prog="pyengine core",
                                     description="an engine-core process serving a front end over zmq")
    parser.add_argument("model", nargs="?", default=None, help="checkpoint folder or hub id (as `pyengine serve`)")
    parser.add_argument("--input", required=True, metavar="ADDRESS",
                        help="the front end's command address (tcp://HOST:PORT or ipc://PATH)")
    parser.add_argument("--output", required=True, metavar="ADDRESS", help="the front end's output address")
    parser.add_argument("--engine-index", type=int, default=0, help="this core's index among the front end's cores")
    # Its default is the protocol's (wire.DEFAULT_HEARTBEAT_TIMEOUT_S), read after the
    # CPUs are pinned: nothing that starts threads (numpy's, torch's) is imported before.
    parser.add_argument("--heartbeat-timeout", type=float, default=None,
                        help="exit after this many seconds without a word from the front end (default: 3, "
                        "as the front end's)")
    parser.add_argument("--cpus", default=None, help="pin to these CPUs (comma-separated ids)")
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ipc-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--config-json", default=None, help=argparse.SUPPRESS)
    return parser, add_engine_flags(parser)


def pin_cpus(cpus: list[int]) -> None:
    """This process (threads started later included) on ``cpus``, and torch's intra-op
    pool sized to them: set before torch is imported, so its OpenMP team starts right."""
    os.sched_setaffinity(0, cpus)
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))


def config_from(ns: argparse.Namespace, engine_names: list[str]) -> Any:
    from pyengine.config import EngineConfig

    if ns.config_json is not None:
        fields = json.loads(ns.config_json)
        return EngineConfig(**{**fields, "data_parallel_size": 1})
    from pyengine.cli.engine_flags import engine_kwargs

    kwargs = engine_kwargs(ns, engine_names)
    kwargs["data_parallel_size"] = 1  # the front end's setting; this process is one core
    return EngineConfig.from_kwargs(ns.model, **kwargs)


def main(argv: Optional[list[str]] = None) -> int:
    parser, engine_names = build_parser()
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if ns.cpus:
        pin_cpus([int(c) for c in ns.cpus.split(",")])
    logging.basicConfig(level=logging.WARNING, format=f"engine core {ns.engine_index}: %(levelname)s %(message)s")
    if ns.heartbeat_timeout is None:
        from pyengine.multiprocess.wire import DEFAULT_HEARTBEAT_TIMEOUT_S

        ns.heartbeat_timeout = DEFAULT_HEARTBEAT_TIMEOUT_S
    from pyengine.multiprocess.watchdog import FrontEndWatch, flush_standard_streams

    # Watching the parent before anything slow (imports, reading the config, the load): a
    # front end that dies meanwhile takes this process with it.
    watch = FrontEndWatch(ns.engine_index, ns.parent_pid, ns.heartbeat_timeout, ns.ipc_dir)
    watch.start()
    from pyengine.engine.thread_names import name_current_thread

    name_current_thread(f"pyengine-core{ns.engine_index}")
    if ns.cpus:
        import torch

        torch.set_num_threads(len(ns.cpus.split(",")))
    from pyengine.multiprocess import wire
    from pyengine.multiprocess.core_loop import LOAD_FAILED_LINGER_MS, CoreLink, CoreMainLoop

    try:
        config = config_from(ns, engine_names)
    except Exception as error:  # noqa: BLE001 - an argument error is a load failure the front end reports
        import zmq

        print(f"pyengine core: {error}", file=sys.stderr, flush=True)
        context = zmq.Context()
        link = CoreLink(context, ns.input, ns.output, ns.engine_index)
        link.hello(wire.LoadFailed(ns.engine_index, *wire.error_to_wire(error)))
        link.close(linger_ms=LOAD_FAILED_LINGER_MS)
        context.term()
        return 2
    core = CoreMainLoop(config, ns.input, ns.output, ns.engine_index, ns.parent_pid, ns.heartbeat_timeout,
                       ns.ipc_dir, watch=watch, freeze_heap=True)
    # SIGINT (and SIGTERM for a core started by hand): the shutdown a front end would ask
    # for (requests in flight fail, threads joined), not a traceback. A core with a parent
    # ignores SIGTERM: a supervisor that signals the whole group (systemd) reaches the
    # front end too, which drains its requests and then sends Shutdown.
    signal.signal(signal.SIGINT, lambda *_: core.stop_requested.set())
    if ns.parent_pid is None:
        signal.signal(signal.SIGTERM, lambda *_: core.stop_requested.set())
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    code = core.run()
    # Everything is joined, closed and sent: skip the interpreter's teardown of torch and
    # friends (most of a second), which a front end waiting for its cores would wait out.
    try:
        logging.shutdown()
    finally:
        flush_standard_streams()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
