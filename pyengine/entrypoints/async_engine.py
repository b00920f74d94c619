"""``AsyncEngine``: stream outputs into any asyncio event loop.

The output thread hands each output to the caller's loop with
``loop.call_soon_threadsafe``; cancelling the consuming task (or leaving the ``async for``
early) aborts the request. It is the in-process ``EngineClient``: the server sees only
that interface, never the ``EngineCore`` behind ``self.engine_core``. The engine core in a
process of its own is the other client, ``MultiprocessEngine``; ``make_engine_client``
(``client_factory.py``) builds either.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any, Optional, Union

from pyengine.config import EngineConfig
from pyengine.engine.core import EngineCore
from pyengine.entrypoints.engine_client import EngineClient, normalize_off_loop, until_finished
from pyengine.errors import InvalidConfigError
from pyengine.inputs.prompts import PromptType
from pyengine.outputs import (
    AnyOutput,
    EmbeddingRequestOutput,
    EngineHealth,
    EngineStats,
    OutputKind,
    RequestOutput,
    ThreadStack,
)
from pyengine.sampling_params import PoolingParams, SamplingParams
from pyengine.text.encode import encode_ids


class _LoopSink:
    """Delivers outputs (and a failure) into an asyncio queue owned by another thread's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Union[AnyOutput, BaseException]] = asyncio.Queue()

    def _deliver(self, item: Union[AnyOutput, BaseException]) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the caller's loop is closed: nobody is listening any more

    def put(self, output: AnyOutput) -> None:
        self._deliver(output)

    def fail(self, error: BaseException) -> None:
        self._deliver(error)


class AsyncEngine(EngineClient):
    """The engine for asyncio programs: ``async for out in engine.generate(...)``.
    ``engine_core`` is the ``EngineCore`` (for tests and offline use; servers use the
    ``EngineClient`` methods only)."""

    def __init__(self, model: Optional[Union[str, Path]] = None, *, multiprocess: bool = False,
                 **engine_args: Any) -> None:
        """``multiprocess=True`` is refused: an ``AsyncEngine`` is always in-process (it used
        to return a ``MultiprocessEngine``, an object of another class)."""
        if multiprocess:
            raise InvalidConfigError(
                "AsyncEngine runs the engine in this process; for engine cores in processes of their own use "
                "pyengine.make_engine_client(EngineConfig.from_kwargs(model, ...), multiprocess=True)")
        self.config = EngineConfig.from_kwargs(model, **engine_args)
        self.engine_core = EngineCore(self.config)
        self._auto_ids = itertools.count()

    @classmethod
    def from_engine_core(cls, core: EngineCore) -> AsyncEngine:
        """Wraps an already built engine (e.g. one with a synthetic executor)."""
        engine = cls.__new__(cls)
        engine.config, engine.engine_core, engine._auto_ids = core.config, core, itertools.count()
        return engine

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Builds the engine in this process from an already validated config."""
        return cls.from_engine_core(EngineCore(config))

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        *,
        output_kind: OutputKind = "cumulative",
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs: cumulative (default), deltas, or only the final
        one (``output_kind``). Raises the request's error, if it fails."""
        params = sampling_params or SamplingParams()
        async with aclosing(self._stream(prompt, params, request_id, output_kind, priority)) as outputs:
            async for out in outputs:
                yield out  # type: ignore[misc]

    async def embed(self, prompt: PromptType, pooling_params: Optional[PoolingParams] = None,
                    request_id: Optional[str] = None) -> EmbeddingRequestOutput:
        result = None
        async with aclosing(self._stream(prompt, pooling_params or PoolingParams(), request_id, "final", 0)) as outs:
            async for out in outs:
                result = out
        assert isinstance(result, EmbeddingRequestOutput)
        return result

    async def _stream(self, prompt: PromptType, params: Union[SamplingParams, PoolingParams],
                      request_id: Optional[str], kind: OutputKind, priority: int) -> AsyncIterator[AnyOutput]:
        rid = request_id if request_id is not None else f"async-{next(self._auto_ids)}"
        text, token_ids = await normalize_off_loop(prompt, self.tokenize)
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            await self.prepare(params)
        sink = _LoopSink(asyncio.get_running_loop())
        self.engine_core.add_request(rid, text, token_ids, params, sink, kind=kind, priority=priority)
        async with aclosing(until_finished(sink.queue, lambda: self.engine_core.abort(rid))) as outputs:
            async for item in outputs:
                yield item

    async def prepare(self, sampling_params: SamplingParams) -> None:
        """Compiles the request's constraint in a worker thread (the GIL released), so the
        event loop never compiles; ``add_request`` then finds it in the cache. Returns at
        once, without leaving the loop, when it is cached already."""
        so = sampling_params.structured_outputs
        if so is None:
            return
        so.validate()
        if not self.engine_core.constraints.is_cached(so):
            await asyncio.get_running_loop().run_in_executor(None, self.engine_core.compile_structured_outputs,
                                                             sampling_params)

    async def abort(self, request_id: str) -> None:
        """Aborts a request; its stream ends with ``finish_reason == "abort"``."""
        self.engine_core.abort(request_id)

    # ---- the model and its text (EngineClient) ----

    @property
    def model_path(self) -> str:
        return str(self.engine_core.model_path)

    @property
    def tokenizer_path(self) -> str:
        return str(self.engine_core.tokenizer_path)

    @property
    def generation_defaults(self) -> dict[str, Any]:
        return dict(self.engine_core.generation_defaults)

    @property
    def max_model_len(self) -> int:
        return int(self.engine_core.max_model_len)

    @property
    def max_request_tokens(self) -> int:
        """``max_model_len``, or the whole KV pool's tokens when that is smaller: the
        scheduler refuses a request needing more blocks than the pool has."""
        return int(self.engine_core.max_request_tokens)

    @property
    def vocab_size(self) -> Optional[int]:
        if self.engine_core.vocab_size:
            return int(self.engine_core.vocab_size)
        tokenizer = self.engine_core.tokenizer
        return tokenizer.get_vocab_size() if tokenizer is not None else None

    @property
    def max_logprobs(self) -> int:
        return int(self.config.max_logprobs)

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.engine_core.eos_token_ids)

    @property
    def tokenizer_config(self) -> dict[str, Any]:
        return self.engine_core.tokenizer_config

    @property
    def tokenizer(self) -> Any:
        return self.engine_core.tokenizer

    @property
    def token_bytes(self) -> Optional[Sequence[bytes]]:
        return getattr(self.engine_core.decode_table, "token_bytes", None)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if add_special_tokens or self.engine_core.tokenizer is None:
            return self.engine_core.tokenize(text)  # the engine's own (and its error without a tokenizer)
        return encode_ids(self.engine_core.tokenizer, text, add_special_tokens=False)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.engine_core.decode(token_ids, skip_special_tokens)

    # ---- health, figures, lifetime (EngineClient) ----

    def health(self) -> EngineHealth:
        pending = self.engine_core.num_unfinished()
        return EngineHealth(self.engine_core.dead_reason(), self.engine_core.steps_executed, pending)

    @property
    def is_alive(self) -> bool:
        return self.engine_core.is_alive  # also False once shut down

    def thread_stacks(self) -> list[ThreadStack]:
        return self.engine_core.thread_stacks()

    def stats(self) -> EngineStats:
        return self.engine_core.stats()

    def shutdown(self, timeout: float = 10.0) -> None:
        self.engine_core.shutdown(timeout)

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()

    def __enter__(self) -> AsyncEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
