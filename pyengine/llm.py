"""``LLM``: the offline API (vLLM-compatible: ``generate``, ``embed``)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

from pyengine.config import EngineConfig
from pyengine.engine.core import EngineCore
from pyengine.errors import EngineDeadError, InvalidRequestError
from pyengine.outputs import EmbeddingRequestOutput, EngineStats, RequestOutput
from pyengine.prompts import PromptType, is_single_prompt, normalize_prompt
from pyengine.sampling_params import PoolingParams, SamplingParams

_WAIT_SLICE_S = 0.2  # how often the waiting caller refreshes the progress bar


class _BatchCollector:
    """Collects the final outputs of one ``generate`` / ``embed`` call (output thread ->
    calling thread)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.results: dict[str, Any] = {}
        self.error: Optional[BaseException] = None
        self.output_tokens = 0

    def put(self, output: Any) -> None:
        with self.cond:
            self.results[output.request_id] = output
            if isinstance(output, RequestOutput):
                self.output_tokens += sum(len(o.token_ids) for o in output.outputs)
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = error
            self.cond.notify_all()


class LLM:
    """Load a model and generate from Python, in batches.

    ``LLM(model=None, **engine_args)``: ``model`` is a Hugging Face checkpoint folder, or
    None for the built-in tiny default. Engine arguments are the fields of
    :class:`~pyengine.config.EngineConfig` (unknown ones are an error).
    """

    def __init__(self, model: Optional[Union[str, Path]] = None, **engine_args: Any) -> None:
        self.config = EngineConfig.from_kwargs(model, **engine_args)
        self.engine = EngineCore(self.config)
        self._request_ids = itertools.count()

    @classmethod
    def from_engine_core(cls, core: EngineCore) -> LLM:
        """Wraps an already built engine (e.g. one with a synthetic executor)."""
        llm = cls.__new__(cls)
        llm.config, llm.engine, llm._request_ids = core.config, core, itertools.count()
        return llm

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        use_tqdm: bool = True,
        priority: Optional[Sequence[int]] = None,
    ) -> list[RequestOutput]:
        """Generates for each prompt; returns the outputs in input order.

        ``prompts``: a string, a list of token ids, a ``{"prompt_token_ids": ...}`` dict, or a
        list of those. ``sampling_params``: one for all, or one per prompt. Raises the error
        of the first request that fails (the others are aborted). Ctrl-C aborts the batch
        and leaves the engine usable.
        """
        items = [prompts] if is_single_prompt(prompts) else list(prompts)  # type: ignore[list-item]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = _per_prompt(sampling_params, len(items), "sampling_params")
        priorities = list(priority) if priority is not None else [0] * len(items)
        if len(priorities) != len(items):
            raise InvalidRequestError(f"priority has {len(priorities)} entries for {len(items)} prompts")
        return self._run(items, params, priorities, use_tqdm, "generate")

    def embed(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
        *,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Pooled, (by default) L2-normalised hidden states of each prompt."""
        items = [prompts] if is_single_prompt(prompts) else list(prompts)  # type: ignore[list-item]
        params = _per_prompt(pooling_params or PoolingParams(), len(items), "pooling_params")
        return self._run(items, params, [0] * len(items), use_tqdm, "embed")

    def _run(self, items: list, params: list, priorities: list[int], use_tqdm: bool, what: str) -> list:
        engine = self.engine
        normalized = [normalize_prompt(p, engine.tokenize) for p in items]  # validate all first
        collector = _BatchCollector()
        ids: list[str] = []
        try:
            for (text, token_ids), p, prio in zip(normalized, params, priorities):
                rid = str(next(self._request_ids))
                engine.add_request(rid, text, token_ids, p, collector, kind="final", priority=prio)
                ids.append(rid)
            self._wait(collector, ids, use_tqdm, what)
        except BaseException:
            for rid in ids:
                if rid not in collector.results:
                    engine.abort(rid)
            raise
        return [collector.results[rid] for rid in ids]

    def _wait(self, collector: _BatchCollector, ids: list[str], use_tqdm: bool, what: str) -> None:
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc=what, unit="req", dynamic_ncols=True)
        started = time.perf_counter()
        try:
            with collector.cond:
                while len(collector.results) < len(ids):
                    if collector.error is not None:
                        raise collector.error
                    collector.cond.wait(_WAIT_SLICE_S)
                    if bar is not None:
                        bar.n = len(collector.results)
                        rate = collector.output_tokens / max(1e-9, time.perf_counter() - started)
                        bar.set_postfix_str(f"{rate:,.0f} tok/s out", refresh=True)
                    if collector.error is None and len(collector.results) < len(ids) and not self.engine.is_alive:
                        raise EngineDeadError(self.engine.dead_reason() or "the engine stopped")
                if collector.error is not None:
                    raise collector.error
        finally:
            if bar is not None:
                bar.close()

    def stats(self) -> EngineStats:
        """Per-thread busy/idle time, step times, queue depths, KV usage, cache hit rate."""
        return self.engine.stats()

    def shutdown(self, timeout: float = 10.0) -> None:
        self.engine.shutdown(timeout)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _per_prompt(params: Any, count: int, name: str) -> list:
    if isinstance(params, (SamplingParams, PoolingParams)):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise InvalidRequestError(f"{name} has {len(params)} entries for {count} prompts")
    return params
