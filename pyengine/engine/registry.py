"""Live requests and sequences, shared by the caller threads, the executor and the output
thread. One lock orders "add a request" against "the executor looks up a new sequence's
parameters", so a plan can never name a sequence the executor has not heard of."""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Optional, Union

from pyengine.engine.request_state import RequestState, SampleState
from pyengine.sampling_params import PoolingParams, SamplingParams

Params = Union[SamplingParams, PoolingParams]


class SequenceRegistry:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._requests: dict[str, RequestState] = {}
        self._seqs: dict[int, tuple[RequestState, SampleState]] = {}
        self._params: dict[int, Params] = {}
        self.prompt_tokens = 0  # prompt tokens of every request added (under ``lock``)

    def add(self, state: RequestState) -> None:
        """Registers a request whose sequences the scheduler has just numbered (call with
        ``lock`` held, together with the scheduler's ``add_request``)."""
        self._requests[state.request_id] = state
        self.prompt_tokens += len(state.prompt_token_ids)
        for sample in state.samples:
            self._seqs[sample.seq_id] = (state, sample)
            self._params[sample.seq_id] = sample_params(state.params, sample.index)

    def contains_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def params_for(self, seq_ids: list[int]) -> dict[int, Params]:
        """Parameters of the given sequences that are still live (a request that failed or
        was aborted may still be in a plan made before the scheduler heard of it)."""
        with self.lock:
            return {s: self._params[s] for s in seq_ids if s in self._params}

    def mark_scheduled(self, seq_ids: list[int], now: float) -> None:
        """Records when the given (new) sequences' requests were first scheduled."""
        for s in seq_ids:
            entry = self._seqs.get(s)
            if entry is not None and entry[0].metrics.first_scheduled_time is None:
                entry[0].metrics.first_scheduled_time = now

    def seq(self, seq_id: int) -> Optional[tuple[RequestState, SampleState]]:
        return self._seqs.get(seq_id)

    def request(self, request_id: str) -> Optional[RequestState]:
        return self._requests.get(request_id)

    def forget_seq(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
        self._params.pop(seq_id, None)

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


def sample_params(params: Params, index: int) -> Params:
    """Parameters of sample ``index``: a seeded request's samples get seeds seed, seed+1, ...
    so that they differ from each other and stay reproducible."""
    if isinstance(params, SamplingParams) and params.seed is not None and index > 0:
        return replace(params, seed=params.seed + index, n=1)
    return params
