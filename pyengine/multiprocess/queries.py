"""Figures asked of the engine cores over the link (``wire.Query`` / ``wire.Reply``): their
stats and their threads' stacks, for ``/metrics``, ``stats()`` and ``thread_stacks()``.

The asker (any thread but the receiver) sends one ``Query`` per core and waits, bounded by
``QUERY_TIMEOUT_S``, for the replies the receiver thread files here.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from pyengine.errors import EngineDeadError, EngineError
from pyengine.multiprocess import wire
from pyengine.multiprocess.cores import CoreState

QUERY_TIMEOUT_S = 10.0


class CoreQueries:
    """The queries waiting for replies; ``send`` is the link's, ``check_alive`` raises
    ``EngineDeadError`` once the front end is dead."""

    def __init__(self, cores: Sequence[CoreState], send: Callable[[int, Any], None],
                 check_alive: Callable[[], None]) -> None:
        self._cores = cores
        self._send = send
        self._check_alive = check_alive
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._waiting: dict[int, tuple[threading.Event, list[wire.Reply]]] = {}

    def file(self, reply: wire.Reply) -> None:
        """The receiver thread's: a core's reply to the query it answers."""
        with self._lock:
            waiter = self._waiting.get(reply.query_id)
        if waiter is not None:
            waiter[1].append(reply)
            waiter[0].set()

    def wake_all(self) -> None:
        """A core died: every asker looks again (and sees it dead)."""
        with self._lock:
            waiters = list(self._waiting.values())
        for event, _ in waiters:
            event.set()

    def _register(self) -> tuple[int, threading.Event, list[wire.Reply]]:
        query_id = next(self._ids)
        event, replies = threading.Event(), []
        with self._lock:
            self._waiting[query_id] = (event, replies)
        return query_id, event, replies

    def _unregister(self, query_id: int) -> None:
        with self._lock:
            self._waiting.pop(query_id, None)

    def ask(self, what: str) -> list[wire.Reply]:
        """Every core's answer to ``what``; ``EngineDeadError`` when one cannot answer."""
        self._check_alive()
        query_id, event, replies = self._register()
        try:
            for core in self._cores:
                self._send(core.index, wire.Query(query_id, what))
            deadline = time.monotonic() + QUERY_TIMEOUT_S
            while len(replies) < len(self._cores):
                event.wait(max(0.0, deadline - time.monotonic()))
                event.clear()
                self._check_alive()
                if time.monotonic() > deadline and len(replies) < len(self._cores):
                    raise EngineError(f"engine cores did not answer {what!r} within {QUERY_TIMEOUT_S:.0f}s")
        except zmq.Again:
            # A core that is not reading (stalled, or busy for longer than its queue lasts)
            # is not dead: its process and its heartbeat decide that.
            raise EngineError(f"an engine core's command queue is full, so {what!r} could not be asked: "
                              "try again") from None
        except zmq.ZMQError as error:
            raise EngineDeadError(f"an engine core is unreachable: {error}") from None
        finally:
            self._unregister(query_id)
        for reply in replies:
            if reply.error is not None:
                raise EngineDeadError(f"engine core {reply.engine_index}: {reply.error}")
        return sorted(replies, key=lambda r: r.engine_index)

    def ask_live(self, what: str, asked: Sequence[CoreState]) -> dict[int, wire.Reply]:
        """The answer to ``what`` of each core in ``asked`` (those alive), by engine index; a
        core that dies meanwhile, answers with an error or not within ``QUERY_TIMEOUT_S`` is
        left out (one dead core must not hide the others' figures)."""
        query_id, event, replies = self._register()
        try:
            sent = []
            for core in asked:
                try:
                    self._send(core.index, wire.Query(query_id, what))
                    sent.append(core)
                except zmq.ZMQError:
                    pass  # unreachable or its queue is full: left out
            deadline = time.monotonic() + QUERY_TIMEOUT_S
            while time.monotonic() < deadline:
                answered = {r.engine_index for r in list(replies)}
                if all(c.index in answered or c.dead is not None for c in sent):
                    break
                event.wait(min(0.1, max(0.0, deadline - time.monotonic())))
                event.clear()
        finally:
            self._unregister(query_id)
        return {r.engine_index: r for r in list(replies) if r.error is None}
