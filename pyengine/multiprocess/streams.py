"""The front end's record of one request in flight on an engine core: where its outputs go
(an asyncio queue on the caller's loop) and, for a caller who asked for cumulative
outputs, what the deltas that crossed the link add up to."""

from __future__ import annotations

import asyncio
from typing import Optional, Union

from pyengine.logprobs import PromptLogprobs, SampleLogprobs
from pyengine.multiprocess import wire
from pyengine.multiprocess.front_text import FrontEndText
from pyengine.multiprocess.wire_logprobs import logprobs_from_wire
from pyengine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    OutputKind,
    RequestMetrics,
    RequestOutput,
)

AnyOutput = Union[RequestOutput, EmbeddingRequestOutput]


def wire_kind(kind: OutputKind) -> str:
    """What the core sends for a caller who asked for ``kind``: deltas (a cumulative
    caller's are added up here, so the link never carries a request's whole text again
    each step), or the final output."""
    return "final" if kind == "final" else "delta"


class RequestStream:
    """Built on the caller's loop; ``output`` runs on the link's receiver thread."""

    def __init__(self, request_id: str, engine_index: int, kind: OutputKind, prompt: Optional[str],
                 prompt_token_ids: list[int], pooling: bool, text: Optional[FrontEndText] = None) -> None:
        self.request_id = request_id
        self.engine_index = engine_index
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Union[AnyOutput, BaseException]] = asyncio.Queue()
        self.kind = kind
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.pooling = pooling
        self.text = text  # the text made here from the ids (the core sends none), or None
        self._sofar: dict[int, CompletionOutput] = {}  # cumulative: each sample so far
        self._prompt_logprobs: Optional[PromptLogprobs] = None

    @property
    def wire_kind(self) -> str:
        return wire_kind(self.kind)

    def output(self, w: wire.WireOutput) -> AnyOutput:
        # The core always sends a request's metrics; a peer that did not gets empty ones.
        metrics = RequestMetrics(*w.metrics) if w.metrics is not None else RequestMetrics(arrival_time=0.0)
        if self.pooling:
            vector = w.embedding.tolist() if w.embedding is not None else []
            return EmbeddingRequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                                          EmbeddingOutput(vector), True, metrics)
        text = self.text
        texts = [c.text if text is None else text.delta(c.index, c.token_ids, c.finish_reason) for c in w.completions]
        if self.kind == "cumulative":
            completions = [self._add(c, t) for c, t in zip(w.completions, texts)]
        else:
            completions = [CompletionOutput(c.index, t, c.token_ids, c.cumulative_logprob, _sample_logprobs(c),
                                            c.finish_reason, c.stop_reason) for c, t in zip(w.completions, texts)]
        prompt_logprobs = logprobs_from_wire(w.prompt_logprobs) if w.prompt_logprobs is not None else None
        if self.kind == "cumulative":  # the core sends them once; every cumulative output carries them
            self._prompt_logprobs = prompt_logprobs = prompt_logprobs or self._prompt_logprobs
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, w.finished, metrics,
                             w.num_cached_tokens, prompt_logprobs)

    def _add(self, c: wire.WireCompletion, text: str) -> CompletionOutput:
        acc = self._sofar.get(c.index)
        if acc is None:
            acc = self._sofar[c.index] = CompletionOutput(c.index, "", [], logprobs=[] if c.logprobs is not None
                                                          else None)
        acc.text += text
        acc.token_ids.extend(c.token_ids)
        logprobs = _sample_logprobs(c)
        if logprobs is not None and acc.logprobs is not None:
            acc.logprobs.extend(logprobs)
        acc.cumulative_logprob, acc.finish_reason, acc.stop_reason = c.cumulative_logprob, c.finish_reason, \
            c.stop_reason
        # A fresh object each time, as an in-process engine's cumulative outputs are.
        return CompletionOutput(acc.index, acc.text, list(acc.token_ids), acc.cumulative_logprob,
                                list(acc.logprobs) if acc.logprobs is not None else None, acc.finish_reason,
                                acc.stop_reason)


def _sample_logprobs(c: wire.WireCompletion) -> Optional[SampleLogprobs]:
    if c.logprobs is None:
        return None
    return [p if p is not None else {} for p in logprobs_from_wire(c.logprobs)]


def deliver(items: list[tuple[RequestStream, Union[AnyOutput, BaseException]]]) -> None:
    """Runs on one caller loop: every item of one message for that loop, in order."""
    for stream, item in items:
        stream.queue.put_nowait(item)
