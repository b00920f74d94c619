"""The core's watch on its front end: a thread of its own, independent of every send.

It checks, every 0.1 s, that the parent process (a core the front end started) is still
there and, once the core serves, that the front end spoke within ``heartbeat_timeout``
(silence counts only while the main thread waits for commands: a long command is not a
silent front end, and the heartbeats it queued are read right after it). Started before
the model loads, so a front end that dies during a long load takes its core with it too.

When the front end is gone: during the load (which cannot be interrupted) the process
exits at once; while serving, ``on_gone`` asks the core to stop (it shuts the engine down
and joins its threads) and, should that not happen within ``grace_s``, the process exits
anyway. Either way, when the parent process is gone, the front end's ipc socket files,
which nobody else is left to remove, are removed (a front end that is only silent, stopped
or slow, still owns them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

logger = logging.getLogger(__name__)

CHECK_INTERVAL_S = 0.1
#: How long a serving core whose front end is gone gets to stop its engine (which it asks
#: to stop within ``GONE_SHUTDOWN_TIMEOUT_S``) before the process exits anyway.
GONE_GRACE_S = 1.5


class FrontEndWatch:
    """See the module docstring. ``heard`` / ``busy`` / ``idle`` come from the main thread."""

    def __init__(self, engine_index: int, parent_pid: Optional[int], heartbeat_timeout: float,
                 ipc_dir: Optional[str], grace_s: float = GONE_GRACE_S) -> None:
        self.engine_index = engine_index
        self.parent_pid = parent_pid
        self.heartbeat_timeout = heartbeat_timeout
        self.ipc_dir = ipc_dir
        self.grace_s = grace_s
        self.gone_reason: Optional[str] = None
        self._on_gone: Optional[Callable[[str], None]] = None
        self._last_heard = time.monotonic()
        self._busy = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pyengine-core{engine_index}-watch", daemon=True)

    def start(self) -> None:
        """Starts the thread (once: a later call does nothing)."""
        if self._thread.ident is None:
            self._thread.start()

    def serving(self, on_gone: Callable[[str], None]) -> None:
        """The engine is up: from now on a gone front end stops it through ``on_gone``, and
        the heartbeat timeout counts."""
        self._last_heard = time.monotonic()
        self._on_gone = on_gone

    def heard(self) -> None:
        """A message arrived; the main thread handles it (not silence, however long)."""
        self._last_heard = time.monotonic()
        self._busy = True

    def idle(self) -> None:
        """The main thread waits for commands again: silence counts from now."""
        self._last_heard = time.monotonic()
        self._busy = False

    def close(self) -> None:
        """The core is exiting on its own: the thread ends."""
        self._done.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * CHECK_INTERVAL_S + 1.0)

    def parent_gone(self) -> bool:
        """Whether the front end's process (this core's parent) is gone: only then are its
        socket files nobody's (a front end that is silent or slow still owns them)."""
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def _reason(self) -> Optional[str]:
        if self.parent_gone():
            return f"the front end (pid {self.parent_pid}) is gone"
        if self._on_gone is not None and not self._busy:
            silent = time.monotonic() - self._last_heard
            if silent > self.heartbeat_timeout:
                return f"no word from the front end for {silent:.1f}s"
        return None

    def _run(self) -> None:
        while not self._done.wait(CHECK_INTERVAL_S):
            reason = self._reason()
            if reason is None:
                continue
            self.gone_reason = reason
            on_gone = self._on_gone
            if on_gone is None:
                self._exit_now("engine core %d: %s while loading; exiting", self.engine_index, reason)
            try:
                logger.error("engine core %d: %s; exiting", self.engine_index, reason)
                on_gone(reason)
            finally:
                if not self._done.wait(self.grace_s):
                    self._exit_now("engine core %d: did not stop within %.0fs; exiting without joining its "
                                   "threads", self.engine_index, self.grace_s)
            return

    def _exit_now(self, *message: object) -> None:
        """Logs ``message``, removes the socket files and ends the process, whatever the
        first two raise. No ``logging.shutdown()``: it walks every handler ever made, and
        one the main thread is constructing right now (an import in the load sets one up)
        has no lock yet, so it raised here and the core lived on. Flushing the standard
        streams is all a log line to stderr needs."""
        try:
            logger.error(*message)
            if self.parent_gone():
                remove_ipc_dir(self.ipc_dir)
        finally:
            flush_standard_streams()
            os._exit(1)


def flush_standard_streams() -> None:
    """Flushes stdout and stderr, whatever state they are in (the process is about to end)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # closed, broken or None: exiting anyway
            stream.flush()


def remove_ipc_dir(ipc_dir: Optional[str]) -> None:
    """Removes the front end's private socket folder and the socket files in it."""
    if not ipc_dir:
        return
    folder = Path(ipc_dir)
    for path in folder.glob("*.sock"):
        path.unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:
        pass  # not empty (not ours to empty further) or already gone
