"""The front end's record of one request in flight on an engine core: where its outputs go
(an asyncio queue on the caller's loop) and, for a caller who asked for cumulative
outputs, what the deltas that crossed the link add up to."""

from __future__ import annotations

import asyncio
from typing import Any, Optional, Union

from pyengine.logprob_arrays import Piece
from pyengine.multiprocess import wire
from pyengine.multiprocess.front_text import FrontEndText
from pyengine.multiprocess.wire_logprobs import logprobs_from_wire
from pyengine.outputs import (
    AnyOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    OutputKind,
    RequestMetrics,
    RequestOutput,
    with_logprob_arrays,
)
from pyengine.sample_totals import SampleTotals


def wire_kind(kind: OutputKind) -> str:
    """What the core sends for a caller who asked for ``kind``: deltas (a cumulative
    caller's are added up here, so the link never carries a request's whole text again
    each step), or the final output."""
    return "final" if kind == "final" else "delta"


class RequestStream:
    """Built on the caller's loop; ``output`` runs on the link's receiver thread. ``piece``
    makes ``Logprob.decoded_token`` when a caller reads log-probability maps (None: the
    request does not detokenize)."""

    def __init__(self, request_id: str, engine_index: int, kind: OutputKind, prompt: Optional[str],
                 prompt_token_ids: list[int], pooling: bool, text: Optional[FrontEndText] = None,
                 piece: Piece = None) -> None:
        self.request_id = request_id
        self.engine_index = engine_index
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Union[AnyOutput, BaseException]] = asyncio.Queue()
        self.kind = kind
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.pooling = pooling
        self.text = text  # the text made here from the ids (the core sends none), or None
        self.piece = piece
        self._sofar: dict[int, SampleTotals] = {}  # cumulative: each sample so far
        self._prompt_logprobs: Any = None  # cumulative: the prompt's, sent once, on every output

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
        text, piece, cumulative = self.text, self.piece, self.kind == "cumulative"
        completions = []
        for c in w.completions:  # each sample's part as it crossed: a delta, or the final output
            out = CompletionOutput(c.index, c.text if text is None else text.delta(c.index, c.token_ids, c.finish_reason),
                                   c.token_ids, c.cumulative_logprob, None, c.finish_reason, c.stop_reason)
            if c.logprobs is not None:
                with_logprob_arrays(out, logprobs_from_wire(c.logprobs, piece))
            completions.append(self._add(out) if cumulative else out)
        out = RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, w.finished, metrics,
                            w.num_cached_tokens)
        prompt_logprobs = logprobs_from_wire(w.prompt_logprobs, piece) if w.prompt_logprobs is not None else None
        if cumulative:  # the core sends them once; every cumulative output carries them
            if prompt_logprobs is None:
                prompt_logprobs = self._prompt_logprobs
            self._prompt_logprobs = prompt_logprobs
        return out if prompt_logprobs is None else with_logprob_arrays(out, prompt_logprobs)

    def _add(self, delta: CompletionOutput) -> CompletionOutput:
        totals = self._sofar.get(delta.index)
        if totals is None:
            totals = self._sofar[delta.index] = SampleTotals(delta.index)
        totals.add(delta)
        return totals.output("cumulative")


def deliver(items: list[tuple[RequestStream, Union[AnyOutput, BaseException]]]) -> None:
    """Runs on one caller loop: every item of one message for that loop, in order."""
    for stream, item in items:
        stream.queue.put_nowait(item)
