"""The output side's record of one request: its samples' tokens and text, and where its
outputs go. Only the output thread mutates it."""

from __future__ import annotations

import time
from typing import Any, Optional, Protocol, Union

import numpy as np

from pyengine.logprob_arrays import LogprobArrays, LogprobBuffer, Piece
from pyengine.outputs import (
    AnyOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    OutputKind,
    RequestMetrics,
    RequestOutput,
    with_logprob_arrays,
)
from pyengine.sample_totals import SampleTotals
from pyengine.sampling_params import PoolingParams, SamplingParams


class OutputSink(Protocol):
    """Where a request's outputs are delivered (called from the output thread)."""

    def put(self, output: AnyOutput) -> None: ...

    def fail(self, error: BaseException) -> None: ...


class TextStreamFactory(Protocol):
    def __call__(self, prompt_token_ids: list[int], params: SamplingParams) -> Any: ...


class SampleState(SampleTotals):
    """One of the request's ``n`` samples: its totals, its sequence and its text stream."""

    __slots__ = ("seq_id", "stream")

    def __init__(self, index: int, stream: Any, logprobs: Optional[LogprobBuffer],
                 cumulative_logprob: Optional[float]) -> None:
        super().__init__(index, logprobs, cumulative_logprob)
        self.seq_id = -1  # numbered by the scheduler: see RequestState.number_samples
        self.stream = stream  # the incremental text stream, or None when text is decoded at the end


class RequestState:
    """Tokens, text and metrics of one request, and its sink."""

    def __init__(
        self,
        request_id: str,
        prompt: Optional[str],
        prompt_token_ids: list[int],
        params: Union[SamplingParams, PoolingParams],
        sink: OutputSink,
        kind: OutputKind,
        decode_text: Any,  # ids -> text at the end; None: no text is made here (the front end makes it)
        text_stream: Optional[TextStreamFactory],
        piece: Piece = None,  # a token's text on its own (Logprob.decoded_token); None: left out
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.sink = sink
        self.kind = kind
        self.metrics = RequestMetrics(arrival_time=time.time())
        self._decode_text = decode_text
        sampling = isinstance(params, SamplingParams)
        n = params.num_candidates if isinstance(params, SamplingParams) else 1
        wants_logprobs = sampling and params.logprobs is not None  # type: ignore[union-attr]
        # best_of > n: the n candidates of highest cumulative log-probability are returned.
        self.best_n: Optional[int] = params.n if isinstance(params, SamplingParams) and n > params.n else None
        self.samples = [
            SampleState(
                i, text_stream(prompt_token_ids, params) if text_stream is not None else None,
                LogprobBuffer(params.logprobs, piece) if wants_logprobs else None,  # type: ignore[union-attr,arg-type]
                0.0 if wants_logprobs or self.best_n is not None else None,
            )
            for i in range(n)
        ]
        # Prompt log-probabilities of positions 1.. (the first has none), written in place
        # as the prompt's chunks are computed; complete once every position has its entry.
        self.wants_prompt = isinstance(params, SamplingParams) and params.prompt_logprobs is not None
        self._piece = piece
        self._prompt_table: Optional[LogprobBuffer] = None  # made by the first chunk (it knows k)
        self._prompt_filled = np.zeros(0, dtype=bool)
        self._prompt_missing = max(0, len(prompt_token_ids) - 1)
        self._prompt_logprobs_sent = False
        self.unfinished = n
        self.embedding: Optional[list[float]] = None
        self.failed = False

    def number_samples(self, first_seq_id: int) -> None:
        """Takes the sequence ids the scheduler gave the samples (consecutive from the first)."""
        for sample in self.samples:
            sample.seq_id = first_seq_id + sample.index

    @property
    def finished(self) -> bool:
        return self.unfinished == 0

    @property
    def _stop_token_ids(self) -> tuple[int, ...]:
        return tuple(getattr(self.params, "stop_token_ids", None) or ())

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Asked for prompt log-probabilities and does not have them all yet."""
        return self.wants_prompt and self._prompt_missing > 0

    def add_prompt_logprobs(self, plp: Any, r: int) -> None:
        """Row ``r`` of a step's ``PromptLogprobsOutput``: entries for prompt tokens
        ``first_positions[r]``, ``+ 1``, ... (a position computed twice, by a recomputed
        prompt, keeps its first entry)."""
        if not self.wants_prompt:
            return
        lo, hi = int(plp.offsets[r]), int(plp.offsets[r + 1])
        size = max(0, len(self.prompt_token_ids) - 1)
        if self._prompt_table is None:  # its k: what the executor computed for this request
            self._prompt_table = LogprobBuffer(int(plp.requested[r]), self._piece, capacity=size)
            self._prompt_filled = np.zeros(size, dtype=bool)
        filled = self._prompt_filled
        # Prompt position p is row p - 1 of the table; positions outside 1 .. len - 1 are not kept.
        rows = np.arange(hi - lo) + (int(plp.first_positions[r]) - 1)
        keep = np.flatnonzero((rows >= 0) & (rows < size))
        keep = keep[~filled[rows[keep]]]
        src = keep + lo
        self._prompt_table.put(rows[keep], plp.token_ids[src], plp.logprobs[src], plp.ranks[src],
                               plp.top_token_ids[src], plp.top_logprobs[src])
        filled[rows[keep]] = True
        self._prompt_missing -= len(keep)

    def _prompt_logprobs_out(self) -> Optional[LogprobArrays]:
        """What this output carries: all of them once complete (a delta output: once)."""
        if not self.wants_prompt or self._prompt_missing > 0:
            return None
        if self.kind == "delta":
            if self._prompt_logprobs_sent:
                return None
            self._prompt_logprobs_sent = True
        table = self._prompt_table
        if table is None:  # a prompt of one token: no position has any
            return LogprobBuffer(0, self._piece, capacity=1).view(0, 0)
        return table.view(0, max(0, len(self.prompt_token_ids) - 1))  # complete: never written again

    @property
    def _keeps_stop_text(self) -> bool:
        return isinstance(self.params, SamplingParams) and self.params.include_stop_str_in_output

    def add_token(self, sample: SampleState, token: int, logprobs: Any = None, row: int = -1,
                  stops: bool = False) -> Optional[str]:
        """Appends a sampled token, with row ``row`` of the step's ``LogprobsOutput``
        ``logprobs`` when the sample keeps log-probabilities; returns the stop string it
        completed, if any. ``stops``: the token ended the sequence (EOS or a stop token id);
        as in vLLM its text is left out of the output (kept with
        ``include_stop_str_in_output``), so that with ``skip_special_tokens=False`` an answer
        does not end in ``<|im_end|>``."""
        now = time.time()
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.last_token_time = now
        sample.token_ids.append(token)
        if logprobs is not None and sample.cumulative_logprob is not None:
            value = float(logprobs.sampled_logprobs[row])
            buffer = sample.logprobs
            if buffer is None:  # best_of's ranking only: the sampled token's, nothing kept
                sample.cumulative_logprob += value
            else:
                sample.cumulative_logprob += buffer.append(token, value, int(logprobs.sampled_ranks[row]),
                                                           logprobs.top_token_ids[row], logprobs.top_logprobs[row])
        if sample.stream is None or (stops and not self._keeps_stop_text):
            return None
        delta = sample.stream.add((token,))
        if delta.text:
            sample.text += delta.text
        return delta.stopped

    def finish_sample(self, sample: SampleState, reason: str, stop_reason: Union[int, str, None] = None) -> None:
        if sample.finish_reason is not None:
            return
        sample.finish_reason = reason
        # vLLM's stop_reason: the stop string, or the stop token id the request listed in
        # stop_token_ids; None when the model's own EOS token ended the sample.
        sample.stop_reason = None if isinstance(stop_reason, int) and stop_reason not in self._stop_token_ids \
            else stop_reason
        if sample.stream is not None:
            sample.text += sample.stream.finish()
        elif self._decode_text is not None and isinstance(self.params, SamplingParams) and self.params.detokenize:
            # A stop token's own text is left out, as add_token leaves it out of a stream.
            ids = sample.token_ids[:-1] if isinstance(stop_reason, int) and not self._keeps_stop_text \
                else sample.token_ids
            sample.text = self._decode_text(ids, self.params.skip_special_tokens)
        self.unfinished -= 1
        if self.unfinished == 0:
            self.metrics.finished_time = time.time()

    def output(self) -> AnyOutput:
        """The output to deliver now, cumulative or delta as the request asked."""
        if isinstance(self.params, PoolingParams):
            return EmbeddingRequestOutput(
                request_id=self.request_id,
                prompt=self.prompt,
                prompt_token_ids=self.prompt_token_ids,
                outputs=EmbeddingOutput(embedding=self.embedding or []),
                finished=True,
                metrics=self.metrics,
            )
        if self.best_n is not None and self.finished:  # best_of: the n best candidates, renumbered
            ranked = sorted(self.samples, key=lambda s: -(s.cumulative_logprob or 0.0))[:self.best_n]
            outputs = [s.output("final") for s in ranked]
            for i, out in enumerate(outputs):
                out.index = i
        else:
            outputs = [s.output(self.kind) for s in self.samples]
        out = RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.metrics.num_cached_tokens,
        )
        prompt_logprobs = self._prompt_logprobs_out()
        return out if prompt_logprobs is None else with_logprob_arrays(out, prompt_logprobs)

