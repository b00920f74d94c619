"""Runs the logits processors over each step's logits, in the executor thread.

Per step: lay the batch out for the step's sampled rows (``ProcessorBatch.step``) ->
every processor's ``update_state`` -> every processor's ``apply`` on the ``[S, vocab]``
logits (argmax-invariant ones skipped when every row of the step decodes greedily and
none asks for logprobs) -> the sampler -> ``record_sampled``.

A processor that raises breaks its own state, so the failing step's rows are failed by
the caller (``row_isolation.process_isolated``) and every processor is rebuilt before
the next step: fresh instances, told every request of the batch as ``added``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Callable, Optional

import numpy as np
import torch

from pyengine.executor.processor_batch import ProcessorBatch
from pyengine.logits_processors.allowed_tokens import AllowedTokenIdsLogitsProcessor
from pyengine.logits_processors.bad_words import BadWordsLogitsProcessor
from pyengine.logits_processors.interface import LogitsProcessor
from pyengine.logits_processors.logit_bias import LogitBiasLogitsProcessor
from pyengine.logits_processors.min_tokens import MinTokensLogitsProcessor
from pyengine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Factory = Callable[[], LogitsProcessor]


class LogitsPipeline:
    def __init__(self, factories: Sequence[Factory], max_rows: int, custom: bool = False) -> None:
        self.factories = list(factories)
        self.custom = custom  # a processor other than the built-in ones is installed
        self.batch = ProcessorBatch(max_rows)
        self.processors = [make() for make in self.factories]
        self.broken = False

    @classmethod
    def build(
        cls, config: Any, device: torch.device, eos_token_ids: Sequence[int], custom: Sequence[type] = ()
    ) -> "LogitsPipeline":
        """The built-in processors (min_tokens, logit_bias, allowed_token_ids, bad_words),
        then ``custom`` classes in the order given, each built as ``cls(config, device,
        is_pin_memory)``."""
        pin = device.type == "cuda"
        factories: list[Factory] = [
            lambda: MinTokensLogitsProcessor(config, device, pin, eos_token_ids=eos_token_ids),
            lambda: LogitBiasLogitsProcessor(config, device, pin),
            lambda: AllowedTokenIdsLogitsProcessor(config, device, pin),
            lambda: BadWordsLogitsProcessor(config, device, pin),
        ]
        factories += [_factory(c, config, device, pin) for c in custom]
        return cls(factories, int(config.max_num_seqs), custom=bool(custom))

    def install(self, row: int, params: SamplingParams, prompt: Optional[list[int]], outputs: list[int]) -> None:
        self.batch.install(row, params, prompt, outputs)

    def free(self, rows: np.ndarray) -> None:
        self.batch.free(rows)

    def maskable_samples(self, sample_rows: np.ndarray) -> np.ndarray:
        """The step's samples (indices into ``sample_rows``) whose processors could mask
        every token: those with allowed_token_ids or bad_words; all with a custom processor."""
        if self.custom:
            return np.arange(len(sample_rows), dtype=np.int64)
        return np.flatnonzero(self.batch.restricts[sample_rows])

    def process(self, logits: torch.Tensor, sample_rows: np.ndarray, greedy_only: bool) -> torch.Tensor:
        """The processed logits of a step sampling ``sample_rows`` (row ``i`` of ``logits``
        is sample ``i``); may modify ``logits`` in place."""
        try:
            update = self.batch.step(sample_rows)
            if self.broken:
                self.processors = [make() for make in self.factories]
                update = self.batch.all_added()
                self.broken = False
            for processor in self.processors:
                processor.update_state(update)
            return self._apply_all(logits, greedy_only)
        except BaseException:
            self.broken = True
            raise

    def apply_again(self, logits: torch.Tensor, greedy_only: bool) -> torch.Tensor:
        """The processors' ``apply`` once more in the step's layout, without a state update
        (a draft position's logits: docs/speculative_decoding.md)."""
        try:
            return self._apply_all(logits, greedy_only)
        except BaseException:
            self.broken = True
            raise

    def _apply_all(self, logits: torch.Tensor, greedy_only: bool) -> torch.Tensor:
        """Every processor's ``apply`` in turn (argmax-invariant ones skipped for greedy rows)."""
        for processor in self.processors:
            if greedy_only and processor.is_argmax_invariant():
                continue
            logits = processor.apply(logits)
        return logits

    def acts_on(self, sample_rows: np.ndarray) -> bool:
        """Some processor may change these rows' logits: a custom one is installed, or a
        row uses a built-in one (min_tokens, logit_bias, allowed_token_ids, bad_words);
        the built-in ones leave every other row as it is."""
        if self.custom:
            return True
        for row in sample_rows.tolist():
            held = self.batch.held.get(row)
            if held is not None:
                p = held[1]
                if p.min_tokens > 0 or p.logit_bias or p.allowed_token_ids or p._bad_words_token_ids:
                    return True
        return False

    def follows_output(self, sample_rows: np.ndarray) -> np.ndarray:
        """Per sampled row: its processors depend on the output so far (min_tokens,
        bad_words; every row when a custom processor is installed), so drafts cannot be
        checked against them."""
        if self.custom:
            return np.ones(len(sample_rows), dtype=bool)
        out = np.zeros(len(sample_rows), dtype=bool)
        for i, row in enumerate(sample_rows.tolist()):
            held = self.batch.held.get(row)
            if held is not None:
                params = held[1]
                out[i] = params.min_tokens > 0 or bool(params._bad_words_token_ids)
        return out

    def record_runs(self, last_token_ids: torch.Tensor, runs: list[list[int]]) -> None:
        """A speculative step's samples: ``runs[i]`` the tokens sample ``i`` emitted (its
        kept drafts, then one more) and ``last_token_ids`` [S] the last of each. The
        output lists get every token; the processors' own ``record_sampled`` the last
        (only sequences that refused their drafts, ``follows_output``, need more, and
        they emit one token)."""
        for outputs, tokens in zip(self.batch.outputs_at, runs):
            outputs.extend(tokens)  # type: ignore[union-attr]
        if self.broken:
            return
        try:
            for processor in self.processors:
                processor.record_sampled(last_token_ids)
        except Exception:  # noqa: BLE001 - rebuilt before the next step; these samples stand
            logger.exception("a logits processor failed to record the step's samples; rebuilding them")
            self.broken = True

    def record_sampled(self, token_ids: torch.Tensor, host_token_ids: np.ndarray) -> None:
        """The step's samples, aligned with its ``sample_rows``."""
        self.batch.record_sampled(host_token_ids.tolist())
        if self.broken:
            return
        try:
            for processor in self.processors:
                processor.record_sampled(token_ids)
        except Exception:  # noqa: BLE001 - rebuilt before the next step; these samples stand
            logger.exception("a logits processor failed to record the step's samples; rebuilding them")
            self.broken = True


def _factory(processor_class: type, config: Any, device: torch.device, pin: bool) -> Factory:
    return lambda: processor_class(config, device, pin)
