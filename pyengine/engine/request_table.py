"""Live requests and their sequences, as the output thread needs them: callers add
(under ``lock``, together with the scheduler's ``add_request``, so a request is known
here before any event can name its sequences), the output thread looks up and forgets.
The executor never reads it: what it needs of a sequence comes in the plan."""

from __future__ import annotations

import threading
from typing import Optional

from pyengine.engine.request_state import RequestState, SampleState


class RequestTable:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._requests: dict[str, RequestState] = {}
        self._seqs: dict[int, tuple[RequestState, SampleState]] = {}
        self.prompt_tokens = 0  # prompt tokens of every request added (under ``lock``)

    def add(self, state: RequestState) -> None:
        """Registers a request whose sequences the scheduler has just numbered (call with
        ``lock`` held, together with the scheduler's ``add_request``)."""
        self._requests[state.request_id] = state
        self.prompt_tokens += len(state.prompt_token_ids)
        for sample in state.samples:
            self._seqs[sample.seq_id] = (state, sample)

    def settle_adds(self) -> None:
        """Waits until no caller is between the scheduler's ``add_request`` and ``add``.

        Call it after receiving an event: every sequence the event names was added to the
        scheduler under ``lock``, so once the lock is free its request is registered here
        (a fast step can otherwise produce a request's first token before its caller has
        registered it). One uncontended lock per event."""
        with self.lock:
            pass

    def contains_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def seq(self, seq_id: int) -> Optional[tuple[RequestState, SampleState]]:
        return self._seqs.get(seq_id)

    def request(self, request_id: str) -> Optional[RequestState]:
        return self._requests.get(request_id)

    def forget_seq(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def forget_request(self, state: RequestState) -> None:
        with self.lock:
            if self._requests.get(state.request_id) is state:
                del self._requests[state.request_id]
            for sample in state.samples:
                self.forget_seq(sample.seq_id)

    def requests(self) -> list[RequestState]:
        with self.lock:
            return list(self._requests.values())

    def __len__(self) -> int:
        return len(self._requests)

