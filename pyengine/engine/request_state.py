"""The output side's record of one request: its samples' tokens and text, and where its
outputs go. Only the output thread mutates it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Protocol, Union

from pyengine.logprobs import Logprob, PromptLogprobs, SampleLogprobs
from pyengine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    OutputKind,
    RequestMetrics,
    RequestOutput,
)
from pyengine.sampling_params import PoolingParams, SamplingParams

AnyOutput = Union[RequestOutput, EmbeddingRequestOutput]


class OutputSink(Protocol):
    """Where a request's outputs are delivered (called from the output thread)."""

    def put(self, output: AnyOutput) -> None: ...

    def fail(self, error: BaseException) -> None: ...


class TextStreamFactory(Protocol):
    def __call__(self, prompt_token_ids: list[int], params: SamplingParams) -> Any: ...


@dataclass
class SampleState:
    """One of the request's ``n`` samples."""

    index: int
    seq_id: int
    stream: Any  # the incremental text stream, or None when text is decoded at the end
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: Optional[SampleLogprobs] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    sent_tokens: int = 0
    sent_text: int = 0


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
                index=i,
                seq_id=-1,  # numbered by the scheduler: see number_samples
                stream=text_stream(prompt_token_ids, params) if text_stream is not None else None,
                logprobs=[] if wants_logprobs else None,
                cumulative_logprob=0.0 if wants_logprobs or self.best_n is not None else None,
            )
            for i in range(n)
        ]
        # Prompt log-probabilities by prompt position (the first has none), filled as the
        # prompt's chunks are computed; complete once every later position has its entry.
        wants_prompt = isinstance(params, SamplingParams) and params.prompt_logprobs is not None
        self.prompt_logprobs: Optional[PromptLogprobs] = [None] * len(prompt_token_ids) if wants_prompt else None
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
        return self.prompt_logprobs is not None and self._prompt_missing > 0

    def add_prompt_logprobs(self, first_position: int, entries: list[dict[int, Logprob]]) -> None:
        """Entries for prompt tokens ``first_position``, ``first_position + 1``, ... (a
        position computed twice, by a recomputed prompt, keeps its first entry)."""
        table = self.prompt_logprobs
        if table is None:
            return
        for position, entry in enumerate(entries, start=first_position):
            if 0 < position < len(table) and table[position] is None:
                table[position] = entry
                self._prompt_missing -= 1

    def _prompt_logprobs_out(self) -> Optional[PromptLogprobs]:
        """What this output carries: all of them once complete (a delta output: once)."""
        if self.prompt_logprobs is None or self._prompt_missing > 0:
            return None
        if self.kind == "delta":
            if self._prompt_logprobs_sent:
                return None
            self._prompt_logprobs_sent = True
        return self.prompt_logprobs  # complete: never written again

    @property
    def _keeps_stop_text(self) -> bool:
        return isinstance(self.params, SamplingParams) and self.params.include_stop_str_in_output

    def add_token(self, sample: SampleState, token: int, logprobs: Optional[dict[int, Logprob]],
                  stops: bool = False) -> Optional[str]:
        """Appends a sampled token; returns the stop string it completed, if any. ``stops``:
        the token ended the sequence (EOS or a stop token id); as in vLLM its text is left
        out of the output (kept with ``include_stop_str_in_output``), so that with
        ``skip_special_tokens=False`` an answer does not end in ``<|im_end|>``."""
        now = time.time()
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.last_token_time = now
        sample.token_ids.append(token)
        if logprobs is not None:
            if sample.logprobs is not None:
                sample.logprobs.append(logprobs)
            chosen = logprobs.get(token)
            if sample.cumulative_logprob is not None and chosen is not None:
                sample.cumulative_logprob += chosen.logprob
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
        outputs = []
        samples = self.samples
        if self.best_n is not None and self.finished:  # best_of: the n best candidates, renumbered
            ranked = sorted(samples, key=lambda s: -(s.cumulative_logprob or 0.0))[:self.best_n]
            samples = [replace(s, index=i) for i, s in enumerate(ranked)]
        for s in samples:
            if self.kind == "delta":
                text, ids = s.text[s.sent_text:], s.token_ids[s.sent_tokens:]
                lps = s.logprobs[s.sent_tokens:] if s.logprobs is not None else None
                s.sent_text, s.sent_tokens = len(s.text), len(s.token_ids)
            else:
                text, ids, lps = s.text, list(s.token_ids), (list(s.logprobs) if s.logprobs is not None else None)
            outputs.append(CompletionOutput(s.index, text, ids, s.cumulative_logprob, lps, s.finish_reason, s.stop_reason))
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.metrics.num_cached_tokens,
            prompt_logprobs=self._prompt_logprobs_out(),
        )
