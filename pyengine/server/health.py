"""``/health`` and its watchdog: healthy means alive *and* making progress.

The engine is unhealthy when a thread died (``EngineCore.dead_reason``) or when requests
are pending and no executor step has finished for ``stall_timeout`` seconds. The
watchdog looks every ``watchdog_interval`` seconds; on entering a stall it logs, once,
which thread looks stuck and the three threads' state: the Python stacks of
``pyengine-exec`` and ``pyengine-output`` (``sys._current_frames``) and, for the native
``pyengine-sched``, its queue depths and busy / idle figures from the engine's stats.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Optional

from pyengine.engine.core import EngineCore
from pyengine.engine.executor_loop import EXEC_THREAD_NAME
from pyengine.engine.output_loop import OUTPUT_THREAD_NAME

SCHED_THREAD_NAME = "pyengine-sched"


@dataclass(frozen=True)
class Health:
    """One verdict: ``status`` is "ok", "stalled" or "dead"."""

    status: str
    reason: Optional[str] = None
    pending_requests: int = 0
    seconds_since_progress: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.status, "pending_requests": self.pending_requests,
                               "seconds_since_progress": round(self.seconds_since_progress, 3)}
        if self.reason is not None:
            out["reason"] = self.reason
        return out


class ProgressMonitor:
    """Tracks when the executor last finished a step (or had nothing to do)."""

    def __init__(self, core: EngineCore, stall_timeout: float) -> None:
        self.core = core
        self.stall_timeout = stall_timeout
        self._steps = core.executor.step_times.count
        self._last_progress = time.monotonic()

    def check(self) -> Health:
        now = time.monotonic()
        pending = self.core.num_unfinished()
        dead = self.core.dead_reason()
        if dead is not None:
            return Health("dead", dead, pending)
        steps = self.core.executor.step_times.count
        if steps != self._steps or pending == 0:
            self._steps = steps
            self._last_progress = now
        since = now - self._last_progress
        if since > self.stall_timeout:
            return Health("stalled", f"{pending} request(s) pending and no step finished for {since:.1f}s",
                          pending, since)
        return Health("ok", None, pending, since)


def _python_stack(name: str) -> Optional[list[str]]:
    frames = sys._current_frames()
    for thread in threading.enumerate():
        if thread.name == name and thread.ident in frames:
            return traceback.format_stack(frames[thread.ident])
    return None


def _innermost_engine_function(stack: Optional[list[str]]) -> str:
    """The innermost pyengine frame's function, from ``format_stack`` lines."""
    for line in reversed(stack or []):
        first = line.strip().splitlines()[0]
        if "pyengine" in first and ", in " in first:
            return first.rsplit(", in ", 1)[1]
    return ""


def diagnose(core: EngineCore) -> dict[str, Any]:
    """Which thread looks stuck, the native scheduler's figures, and a ``stack`` text with
    the Python stacks of the executor and output threads, for the stall log line."""
    exec_stack = _python_stack(EXEC_THREAD_NAME)
    output_stack = _python_stack(OUTPUT_THREAD_NAME)
    exec_fn = _innermost_engine_function(exec_stack)
    output_fn = _innermost_engine_function(output_stack)
    sched: dict[str, Any] = {"native": True, "note": "Rust thread: no Python frames"}
    try:
        stats = core.stats()
        sched.update(stats.threads.get(SCHED_THREAD_NAME, {}))
        sched["queue_depths"] = stats.queue_depths
        sched["running"], sched["waiting"] = stats.num_running, stats.num_waiting
        sched["steps_planned"] = stats.scheduler.get("steps_planned")
        sched["steps_applied"] = stats.scheduler.get("steps_applied")
    except Exception as error:  # noqa: BLE001 - a stuck or dead scheduler may not answer
        sched["stats_error"] = repr(error)
    if exec_fn not in ("", "run"):
        stuck = f"{EXEC_THREAD_NAME} (inside {exec_fn}: a step that does not return)"
    elif output_fn not in ("", "run"):
        stuck = f"{OUTPUT_THREAD_NAME} (inside {output_fn})"
    else:
        stuck = f"{SCHED_THREAD_NAME} (the executor and output threads wait for it; see its queue depths)"
    missing = ["<no Python frames: thread not running>\n"]
    # One "stack" text: structlog's console renderer prints it below the line, as is.
    stack = (f"--- {EXEC_THREAD_NAME} (Python)\n{''.join(exec_stack or missing)}"
             f"--- {OUTPUT_THREAD_NAME} (Python)\n{''.join(output_stack or missing)}"
             f"--- {SCHED_THREAD_NAME} (native Rust thread, no Python frames)\n{sched}\n")
    return {"stuck_thread": stuck, SCHED_THREAD_NAME: sched, "stack": stack}


class Watchdog:
    """Polls the ``ProgressMonitor``; logs a stall (with the thread dump) once per stall,
    and logs the recovery."""

    def __init__(self, monitor: ProgressMonitor, interval: float, logger: Any) -> None:
        self.monitor = monitor
        self.interval = interval
        self.logger = logger
        self.last = Health("ok")
        self.dumps = 0  # how many stall dumps were logged (tests read it)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.step()
            except Exception:  # noqa: BLE001 - the watchdog must outlive any one failure
                self.logger.exception("watchdog check failed")

    async def step(self) -> Health:
        health = self.monitor.check()
        if health.status != "ok" and self.last.status == "ok":
            details = await asyncio.to_thread(diagnose, self.monitor.core)
            self.dumps += 1
            self.logger.error("engine unhealthy", status=health.status, reason=health.reason,
                              pending_requests=health.pending_requests, **details)
        elif health.ok and self.last.status != "ok":
            self.logger.warning("engine healthy again", after_s=round(health.seconds_since_progress, 3))
        self.last = health
        return health
