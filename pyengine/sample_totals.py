"""``SampleTotals``: one sample's output so far, put together from what each step adds.

Three places turn a stream of additions into running totals: the engine core's output
thread (one token at a time, per request), the multi-process front end (the deltas a core
sends, for a caller who asked for cumulative outputs) and the server (each choice of an
HTTP response, from the engine's deltas). They all keep one of these per sample, and the
outputs they hand on are made here: ``output("cumulative")`` (everything so far, in
fresh lists, as vLLM's cumulative outputs are) or ``output("delta")`` (what is new since
the previous delta). Log-probabilities stay arrays (a ``LogprobBuffer``) all the way.
"""

from __future__ import annotations

from typing import Optional, Union

from pyengine.logprob_arrays import LogprobArrays, LogprobBuffer
from pyengine.outputs import CompletionOutput, OutputKind, with_logprob_arrays


class SampleTotals:
    """``logprobs``: the buffer when the request asked for them (None: it did not; a buffer
    is made by the first delta that brings some). ``cumulative_logprob`` None: not kept."""

    __slots__ = ("index", "text", "token_ids", "logprobs", "cumulative_logprob", "finish_reason", "stop_reason",
                 "_sent_text", "_sent_tokens", "_sent_logprobs")

    def __init__(self, index: int, logprobs: Optional[LogprobBuffer] = None,
                 cumulative_logprob: Optional[float] = None) -> None:
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs = logprobs
        self.cumulative_logprob = cumulative_logprob
        self.finish_reason: Optional[str] = None
        self.stop_reason: Union[int, str, None] = None
        self._sent_text = self._sent_tokens = self._sent_logprobs = 0

    def add(self, delta: CompletionOutput) -> None:
        """What one delta output brings; its ``cumulative_logprob`` and end replace what was
        kept."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        arrays = delta.logprob_arrays
        if arrays is not None:
            if self.logprobs is None:
                self.logprobs = LogprobBuffer(arrays.width, arrays.piece, capacity=max(16, len(arrays)))
            self.logprobs.extend(arrays)
        self.cumulative_logprob = delta.cumulative_logprob
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason

    def logprob_arrays(self) -> Optional[LogprobArrays]:
        """Every position so far (None when the request has no log-probabilities)."""
        return self.logprobs.view() if self.logprobs is not None else None

    def output(self, kind: OutputKind) -> CompletionOutput:
        """Everything so far ("cumulative", "final"), or what is new since the last "delta"."""
        logprobs = self.logprobs
        if kind == "delta":
            text, ids = self.text[self._sent_text:], self.token_ids[self._sent_tokens:]
            arrays = logprobs.view(self._sent_logprobs) if logprobs is not None else None
            self._sent_text, self._sent_tokens = len(self.text), len(self.token_ids)
            self._sent_logprobs = len(logprobs) if logprobs is not None else 0
        else:
            text, ids = self.text, list(self.token_ids)
            arrays = logprobs.view() if logprobs is not None else None
        out = CompletionOutput(self.index, text, ids, self.cumulative_logprob, None, self.finish_reason,
                               self.stop_reason)
        return out if arrays is None else with_logprob_arrays(out, arrays)
