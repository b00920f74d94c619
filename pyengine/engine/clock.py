"""Busy and idle time of one engine thread, and a window of recent step times."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager


class ThreadClock:
    """Idle = time spent blocked waiting for work; busy = the rest since ``start``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started: float | None = None
        self._stopped: float | None = None
        self._idle = 0.0
        self._idle_since: float | None = None  # start of the current wait, if waiting

    def start(self) -> None:
        self._started = time.perf_counter()

    def stop(self) -> None:
        self._stopped = time.perf_counter()

    @contextmanager
    def idle(self) -> Iterator[None]:
        t0 = time.perf_counter()
        with self._lock:
            self._idle_since = t0
        try:
            yield
        finally:
            with self._lock:
                self._idle += time.perf_counter() - t0
                self._idle_since = None

    def busy_idle(self) -> tuple[float, float]:
        if self._started is None:
            return 0.0, 0.0
        end = self._stopped if self._stopped is not None else time.perf_counter()
        with self._lock:  # a wait in progress counts as idle already: both figures only grow
            idle = self._idle + (end - self._idle_since if self._idle_since is not None else 0.0)
        return max(0.0, end - self._started - idle), idle


class StepTimes:
    """The last ``window`` step durations, for mean and p99."""

    def __init__(self, window: int = 2048) -> None:
        self._times: deque[float] = deque(maxlen=window)
        self.count = 0

    def add(self, seconds: float) -> None:
        self._times.append(seconds)
        self.count += 1

    def mean_p99_ms(self) -> tuple[float, float]:
        times = sorted(self._times)
        if not times:
            return 0.0, 0.0
        p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
        return 1e3 * sum(times) / len(times), 1e3 * p99
