"""``LLM``'s progress report costs each finished request once: the waiting caller reads
what finished since its last report, never the whole batch again (which made a
10k-request ``generate`` quadratic, and held the collector's lock the output thread
needs to hand over the next output)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from pyengine.entrypoints.llm import LLM, _BatchCollector


class _CountingDict(dict):
    """A dict that counts the entries read from it."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __getitem__(self, key: Any) -> Any:
        self.reads += 1
        return super().__getitem__(key)

    def __iter__(self):
        for key in super().__iter__():
            self.reads += 1
            yield key

    def keys(self):
        return list(iter(self))

    def values(self):
        return [self[k] for k in super().keys()]

    def items(self):
        return [(k, self[k]) for k in super().keys()]


class _LockstepProgress:
    """Records what each report hands over and tells the feeder it arrived."""

    def __init__(self) -> None:
        self.finished: list[int] = []
        self.arrived = threading.Condition()

    def start(self, *_: Any) -> None:
        pass

    def update(self, finished: list[tuple[int, Any]], generated_tokens: int) -> None:
        with self.arrived:
            self.finished.extend(i for i, _ in finished)
            self.arrived.notify_all()

    def close(self) -> None:
        pass


def test_each_finished_request_is_read_a_bounded_number_of_times():
    n = 400
    llm = LLM.__new__(LLM)
    llm.engine_core = SimpleNamespace(output=None, is_alive=True, dead_reason=lambda: None)
    collector = _BatchCollector()
    collector.results = _CountingDict()
    ids = [f"r{i}" for i in range(n)]
    progress = _LockstepProgress()

    def feed() -> None:  # one output per report: the worst case, every wake-up reports
        for i, rid in enumerate(ids):
            collector.put(SimpleNamespace(request_id=rid))
            with progress.arrived:
                if not progress.arrived.wait_for(lambda i=i: len(progress.finished) > i, timeout=10):
                    collector.fail(TimeoutError(f"report of {rid} never came"))
                    return

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        llm._wait(collector, ids, progress)
    finally:
        feeder.join(timeout=15)
    assert not feeder.is_alive()
    assert progress.finished == list(range(n))
    assert collector.results.reads <= 2 * n, f"{collector.results.reads} reads of the results for {n} requests"
