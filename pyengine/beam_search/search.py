"""``BeamSearch``: one prompt's beam search, as a state machine with no engine in it.

The caller asks ``pending()`` for the token sequences to extend (prompt plus each live
beam's tokens), has the engine compute each one's top next-token log-probabilities, and
hands them to ``advance``; until ``done``. The rules are those of Hugging Face
transformers' ``generate(num_beams=k, do_sample=False)`` (the reference the tests hold it
to):

- each step keeps the ``candidates`` = max(2, 1 + number of EOS ids) * k best extensions
  of all live beams together (by summed log-probability);
- the k best of those that do not end the beam (an EOS token, or ``max_tokens`` reached)
  live on;
- an ending candidate among the k best of the step joins the finished ones, scored
  ``sum / generated_len ** length_penalty``, and the k best finished are kept;
- the search ends when every candidate ends its beam, when (``early_stopping=True``) k
  beams have finished, or when no live beam can beat the worst of k finished ones any more
  (at its current length, or at ``max_tokens`` with ``early_stopping="never"`` and a
  positive length penalty).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Optional

from pyengine.beam_search.outputs import BeamSearchSequence
from pyengine.beam_search.params import BeamSearchParams
from pyengine.logprobs import Logprob


@dataclass(frozen=True, slots=True)
class _Beam:
    tokens: tuple[int, ...]  # generated so far
    cum_logprob: float
    logprobs: tuple[Mapping[int, Logprob], ...]  # the engine's candidates, one dict per token


class BeamSearch:
    """The search for one prompt (see the module docstring)."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: Collection[int],
                 max_tokens: Optional[int] = None) -> None:
        """``max_tokens``: the engine's limit for this prompt when it is below
        ``params.max_tokens`` (what the model length leaves)."""
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.width = params.beam_width
        self.max_tokens = params.max_tokens if max_tokens is None else min(max_tokens, params.max_tokens)
        self.eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        #: extensions kept per step, and so the log-probabilities asked per beam
        self.candidates = max(2, 1 + len(self.eos)) * self.width
        self._running = [_Beam((), 0.0, ())]  # k copies of one beam would only give k copies of each candidate
        self._finished: list[tuple[float, _Beam]] = []  # (score, beam), best first, at most k
        self._improvable = True
        self.done = False

    def pending(self) -> list[list[int]]:
        """The sequences whose next-token log-probabilities the next step needs."""
        if self.done:
            return []
        return [self.prompt_token_ids + list(beam.tokens) for beam in self._running]

    def advance(self, next_logprobs: list[Mapping[int, Logprob]]) -> None:
        """One step: ``next_logprobs[i]`` maps token ids to their ``Logprob`` (at least the
        ``candidates`` best) for the i-th sequence of ``pending()``."""
        if len(next_logprobs) != len(self._running):
            raise ValueError(f"{len(next_logprobs)} results for {len(self._running)} beams")
        new_len = len(self._running[0].tokens) + 1
        extensions = []
        for beam, tops in zip(self._running, next_logprobs):
            best = sorted(((v.logprob, t) for t, v in tops.items()), key=lambda item: -item[0])
            for lp, token in best[:self.candidates]:
                extensions.append((beam.cum_logprob + lp, token, beam, tops))
        extensions.sort(key=lambda item: -item[0])  # stable: ties keep beam order, as topk tends to
        extensions = extensions[:self.candidates]
        at_limit = new_len >= self.max_tokens
        ends = [at_limit or token in self.eos for _, token, _, _ in extensions]

        def extend(i: int) -> _Beam:
            total, token, beam, tops = extensions[i]
            return _Beam(beam.tokens + (token,), total, beam.logprobs + (tops,))

        full = len(self._finished) == self.width
        if self._improvable and not (full and self.params.early_stopping is True):
            penalty = new_len ** self.params.length_penalty
            added = [(extensions[i][0] / penalty, extend(i)) for i in range(min(self.width, len(extensions)))
                     if ends[i]]
            if added:
                merged = self._finished + added
                merged.sort(key=lambda item: -item[0])  # stable: earlier finished first on a tie
                self._finished = merged[:self.width]
        self._running = [extend(i) for i in range(len(extensions)) if not ends[i]][:self.width]
        if len(self._finished) == self.width:
            if not self._running:
                self._improvable = False
            else:
                never = self.params.early_stopping == "never" and self.params.length_penalty > 0
                best_len = self.max_tokens if never else new_len
                best_possible = self._running[0].cum_logprob / best_len ** self.params.length_penalty
                self._improvable = self._improvable and best_possible > self._finished[-1][0]
        all_full = len(self._finished) == self.width and self.params.early_stopping is True
        self.done = not self._improvable or all_full or all(ends) or not self._running

    def results(self) -> list[BeamSearchSequence]:
        """The finished sequences, best first (``text`` left for the caller to decode)."""
        out = []
        for score, beam in self._finished:
            last = beam.tokens[-1] if beam.tokens else None
            stopped = last is not None and last in self.eos
            out.append(BeamSearchSequence(
                tokens=self.prompt_token_ids + list(beam.tokens),
                logprobs=[dict(tops) for tops in beam.logprobs],
                cum_logprob=beam.cum_logprob,
                finish_reason="stop" if stopped else "length",
                stop_reason=last if stopped else None,
                score=score,
                num_prompt_tokens=len(self.prompt_token_ids),
            ))
        return out

    def text_tokens(self, sequence: BeamSearchSequence) -> list[int]:
        """The generated tokens ``text`` shows: without a final end-of-sequence token,
        unless ``include_stop_str_in_output``."""
        tokens = sequence.output_token_ids
        if sequence.finish_reason == "stop" and not self.params.include_stop_str_in_output:
            tokens = tokens[:-1]
        return tokens
