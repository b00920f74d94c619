"""``/health`` and its watchdog: healthy means alive *and* making progress.

The engine is unhealthy when a thread died (``EngineHealth.dead_reason``) or when requests
are pending and no executor step has finished for ``stall_timeout`` seconds. The
watchdog looks every ``watchdog_interval`` seconds; on entering a stall it logs, once,
which thread looks stuck and the three threads' state: the Python stacks of the executor
and output threads (``EngineClient.thread_stacks``) and, for the native scheduler, its
queue depths and busy / idle figures from the engine's stats. Everything comes through
the ``EngineClient``: thread names included, so nothing here knows the engine's modules.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Optional

from pyengine.entrypoints.engine_client import EngineClient
from pyengine.outputs import ThreadStack


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

    def __init__(self, engine: EngineClient, stall_timeout: float) -> None:
        self.engine_client = engine
        self.stall_timeout = stall_timeout
        self._steps = engine.health().steps
        self._last_progress = time.monotonic()

    def check(self) -> Health:
        now = time.monotonic()
        seen = self.engine_client.health()
        pending = seen.num_unfinished
        if seen.dead_reason is not None:
            return Health("dead", seen.dead_reason, pending)
        if seen.steps != self._steps or pending == 0:
            self._steps = seen.steps
            self._last_progress = now
        since = now - self._last_progress
        if since > self.stall_timeout:
            return Health("stalled", f"{pending} request(s) pending and no step finished for {since:.1f}s",
                          pending, since)
        return Health("ok", None, pending, since)


def _innermost_engine_function(stack: Optional[list[str]]) -> str:
    """The innermost pyengine frame's function, from ``format_stack`` lines."""
    for line in reversed(stack or []):
        first = line.strip().splitlines()[0]
        if "pyengine" in first and ", in " in first:
            return first.rsplit(", in ", 1)[1]
    return ""


def _by_role(threads: list[ThreadStack], role: str) -> ThreadStack:
    """The thread playing ``role``; a client that lists none gets a stand-in without frames."""
    return next((t for t in threads if t.role == role), ThreadStack(role, role, native=role == "scheduler"))


def diagnose(engine: EngineClient) -> dict[str, Any]:
    """Which thread looks stuck, the native scheduler's figures, and a ``stack`` text with
    the Python stacks of the executor and output threads, for the stall log line."""
    stacks_error = None
    try:
        threads = engine.thread_stacks()
    except Exception as error:  # noqa: BLE001 - a dead or stuck engine may not answer; say so, go on
        threads, stacks_error = [], repr(error)
    sched_t, exec_t, output_t = (_by_role(threads, r) for r in ("scheduler", "executor", "output"))
    exec_fn = _innermost_engine_function(exec_t.stack)
    output_fn = _innermost_engine_function(output_t.stack)
    sched: dict[str, Any] = {"native": True, "note": "Rust thread: no Python frames"}
    try:
        stats = engine.stats()
        sched.update(stats.threads.get(sched_t.name, {}))
        sched["queue_depths"] = stats.queue_depths
        sched["running"], sched["waiting"] = stats.num_running, stats.num_waiting
        sched["steps_planned"] = stats.scheduler.get("steps_planned")
        sched["steps_applied"] = stats.scheduler.get("steps_applied")
    except Exception as error:  # noqa: BLE001 - a stuck or dead scheduler may not answer
        sched["stats_error"] = repr(error)
    if exec_fn not in ("", "run"):
        stuck = f"{exec_t.name} (inside {exec_fn}: a step that does not return)"
    elif output_fn not in ("", "run"):
        stuck = f"{output_t.name} (inside {output_fn})"
    else:
        stuck = f"{sched_t.name} (the executor and output threads wait for it; see its queue depths)"
    missing = ["<no Python frames: thread not running>\n"]
    # One "stack" text: structlog's console renderer prints it below the line, as is.
    stack = (f"--- {exec_t.name} (Python)\n{''.join(exec_t.stack or missing)}"
             f"--- {output_t.name} (Python)\n{''.join(output_t.stack or missing)}"
             f"--- {sched_t.name} (native Rust thread, no Python frames)\n{sched}\n")
    details = {"stuck_thread": stuck, sched_t.name: sched, "stack": stack}
    if stacks_error is not None:
        details["stacks_error"] = stacks_error
    return details


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
            details = await asyncio.to_thread(diagnose, self.monitor.engine_client)
            self.dumps += 1
            self.logger.error("engine unhealthy", status=health.status, reason=health.reason,
                              pending_requests=health.pending_requests, **details)
        elif health.ok and self.last.status != "ok":
            self.logger.warning("engine healthy again", after_s=round(health.seconds_since_progress, 3))
        self.last = health
        return health
