"""``ChoiceTracker``: the choices of one HTTP request, fed with the engine's deltas.

Choice ``i`` of prompt ``p`` is choice ``p * n + i`` of the response (OpenAI's order).
Each ``apply`` returns what is new per choice (for a stream chunk) and keeps the totals
(for a full response and for usage). When an engine request finishes, the tracker
records its metrics and writes its one log line.

Finish reasons are OpenAI's: the engine's ``dead_end`` (a grammar that allows no further
token) is not one, so a client sees ``finish_reason="stop"`` with ``stop_reason="dead_end"``
(the server metrics keep the engine's reason).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Union

from pyengine.logprob_arrays import LogprobArrays
from pyengine.outputs import RequestOutput
from pyengine.sample_totals import SampleTotals
from pyengine.server.context import ServerContext
from pyengine.server.protocol import UsageInfo


class Choice(SampleTotals):
    """Everything generated so far for one choice (``sample_totals.py``), with OpenAI's
    finish reasons."""

    __slots__ = ()


@dataclass
class ChoiceDelta:
    """What one engine output added to one choice."""

    choice: Choice
    text: str
    token_ids: list[int]
    logprobs: Optional[LogprobArrays]  # None: the request asked for none
    finish_reason: Optional[str]
    text_offset: int  # where ``text`` starts in the choice's text


#: Engine finish reasons OpenAI clients do not know: reported as "stop", with the engine's
#: reason in ``stop_reason``.
REPORTED_AS_STOP = frozenset({"dead_end"})


def openai_finish(reason: Optional[str], stop_reason: Union[int, str, None]) -> tuple[Optional[str], Union[int, str, None]]:
    """The ``(finish_reason, stop_reason)`` a client sees for the engine's pair."""
    if reason in REPORTED_AS_STOP:
        return "stop", reason
    return reason, stop_reason


class ChoiceTracker:
    def __init__(self, ctx: ServerContext, request_id: str, prompt_lens: list[int], n: int) -> None:
        self.ctx = ctx
        self.request_id = request_id
        self.prompt_lens = prompt_lens
        self.n = n
        self.choices = [Choice(i) for i in range(len(prompt_lens) * n)]
        # Each prompt's log-probabilities, when the request asked (vLLM's prompt_logprobs).
        self.prompt_logprobs: list[Optional[LogprobArrays]] = [None] * len(prompt_lens)
        self.cached_tokens = 0  # prompt tokens found in the prefix cache, over the finished requests
        self._timers = [ctx.metrics.itl_timer() for _ in prompt_lens]
        self._started = time.perf_counter()

    def apply(self, prompt_index: int, out: RequestOutput) -> list[ChoiceDelta]:
        deltas = []
        new_tokens = 0
        prompt_logprobs = out.prompt_logprob_arrays
        if prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = prompt_logprobs
        for sample in out.outputs:
            choice = self.choices[prompt_index * self.n + sample.index]
            if not (sample.text or sample.token_ids or (sample.finish_reason and not choice.finish_reason)):
                continue
            offset = len(choice.text)
            choice.add(sample)
            new_tokens = max(new_tokens, len(sample.token_ids))
            if sample.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = openai_finish(sample.finish_reason, sample.stop_reason)
            deltas.append(ChoiceDelta(
                choice, sample.text, list(sample.token_ids), sample.logprob_arrays,
                choice.finish_reason if sample.finish_reason is not None else None, offset,
            ))
        self._timers[prompt_index].tick(new_tokens)
        if out.finished:
            self._finished(prompt_index, out)
        return deltas

    def _finished(self, prompt_index: int, out: RequestOutput) -> None:
        mine = self.choices[prompt_index * self.n:(prompt_index + 1) * self.n]
        output_tokens = sum(len(c.token_ids) for c in mine)
        self.cached_tokens += out.num_cached_tokens or 0
        self.ctx.metrics.observe_finished(out, max(len(c.token_ids) for c in mine))
        if not self.ctx.args.log_requests:
            return
        t = out.metrics
        ttft = (t.first_token_time - t.arrival_time) if t.first_token_time is not None else None
        e2e = (t.finished_time - t.arrival_time) if t.finished_time is not None else None
        self.ctx.logger.info(
            "request finished", request_id=out.request_id, prompt_tokens=self.prompt_lens[prompt_index],
            output_tokens=output_tokens, finish_reason=",".join(sorted({c.finish_reason or "?" for c in mine})),
            ttft_s=round(ttft, 4) if ttft is not None else None, e2e_s=round(e2e, 4) if e2e is not None else None,
            cached_tokens=out.num_cached_tokens,
        )

    def usage(self) -> UsageInfo:
        prompt = sum(self.prompt_lens)
        completion = sum(len(c.token_ids) for c in self.choices)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
