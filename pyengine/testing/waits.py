"""The small waits and look-ups that tests and benchmarks share: a free loopback port,
a condition waited for with a bound (``wait_until``), whether a process runs
(``pid_alive``), and an engine that has nothing left in it (``wait_engine_idle``). Every
wait ends by its timeout; none sleeps for a fixed time and hopes."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any, Callable


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on loopback now (all bound at once, then released)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    """A TCP port free on loopback now."""
    return free_ports(1)[0]


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.05) -> bool:
    """Polls ``predicate`` until it is true or ``timeout`` seconds have passed; its last
    answer (so a condition met at the deadline still counts)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def child_pids(pid: int) -> list[int]:
    """The direct children of process ``pid`` (every thread's, as ``/proc`` lists them)."""
    pids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass  # the thread ended meanwhile
    return pids


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not reaped, does not; nor one
    being torn down): what the native ``process_exists`` of ``rust_sched/kernels`` answers."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def engine_idle(engine: Any) -> bool:
    """Whether ``engine`` (an ``LLM``, an ``EngineCore`` or an engine client) holds no
    request and no KV block: nothing running or waiting in the scheduler and, for an
    engine client, no request whose stream has not ended."""
    stats = engine.stats()
    if stats.num_running or stats.num_waiting or stats.kv_usage > 0:
        return False
    health = getattr(engine, "health", None)  # engine clients only: LLM and EngineCore have none
    return health is None or health().num_unfinished == 0


def wait_engine_idle(engine: Any, timeout: float = 10.0) -> bool:
    """``engine_idle(engine)``, waited for up to ``timeout`` seconds (an aborted request
    frees its blocks a step later)."""
    return wait_until(lambda: engine_idle(engine), timeout, interval=0.02)
