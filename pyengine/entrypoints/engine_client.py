"""``EngineClient``: the one interface between a front end (the HTTP server) and an engine.

The server holds an ``EngineClient`` and nothing else of the engine: no ``EngineCore``,
no executor, no thread objects. ``AsyncEngine`` implements it in-process;
``pyengine.multiprocess.client.MultiprocessEngine`` with the engine cores in processes of their
own, over zmq. So everything that crosses this interface is plain data that such a client can
serialise (``RequestOutput``, ``EngineStats``, ``EngineHealth``, ``ThreadStack``, ints,
strings, dicts), and the tokenizer is the front end's own (the design puts tokenization
and chat templates in the front-end process).

An ``abc.ABC`` rather than a ``typing.Protocol``: there are exactly two implementations,
both written on purpose, and an abstract base makes a forgotten method fail when the
client is built instead of when a request first needs it.
"""

from __future__ import annotations

import asyncio
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import Any, Callable, Optional, TypeVar, Union

from pyengine.beam_search import BeamSearchOutput, BeamSearchParams
from pyengine.errors import EngineError
from pyengine.inputs.prompts import PromptType, normalize_prompt
from pyengine.outputs import (
    EmbeddingRequestOutput,
    EngineHealth,
    EngineStats,
    OutputKind,
    RequestOutput,
    ThreadStack,
)
from pyengine.sampling_params import PoolingParams, SamplingParams
from pyengine.text.encode import LONG_TEXT_CHARS

Output = TypeVar("Output", RequestOutput, EmbeddingRequestOutput)


class EngineClient(ABC):
    """What a front end may ask of an engine. Methods that may wait on the engine
    (``stats``, ``thread_stacks``) are synchronous: call them off the event loop."""

    # ---- requests ----

    @abstractmethod
    def generate(
        self,
        prompt: PromptType,
        sampling_params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        *,
        output_kind: OutputKind = "cumulative",
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Streams one request's outputs (an async generator). Raises the engine's error if
        the request is refused or fails; leaving the iteration early aborts the request."""

    async def prepare(self, sampling_params: SamplingParams) -> None:
        """Does the work a request with these parameters needs before it is added (compiling
        its structured-outputs constraint), off the event loop; raises the error adding it
        would raise (``InvalidRequestError`` for a bad constraint). After it, ``generate``
        reaches the engine without waiting. Optional: ``generate`` does it too. The default
        does nothing (an engine in another process compiles there, off this loop)."""
        return None

    async def beam_search(self, prompts: Sequence[PromptType], params: BeamSearchParams,
                          request_id: Optional[str] = None) -> list[BeamSearchOutput]:
        """Beam search for each prompt, as ``LLM.beam_search`` (docs/beam_search.md), on top
        of ``generate``: each step's beams are ordinary one-token requests, all in flight
        together, named ``{request_id}-{step}-{i}``. Raises ``InvalidRequestError`` for a
        search the engine cannot run; cancelling the call aborts the step's requests."""
        from pyengine.beam_search.online import beam_search

        return await beam_search(self, prompts, params, request_id or f"beam-{uuid.uuid4().hex}")

    @abstractmethod
    async def embed(self, prompt: PromptType, pooling_params: Optional[PoolingParams] = None,
                    request_id: Optional[str] = None) -> EmbeddingRequestOutput:
        """The pooled vector of one prompt; cancelling the call aborts the request."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Aborts a request at any stage; unknown or finished ids are ignored."""

    # ---- the model, as the front end needs it ----

    @property
    @abstractmethod
    def model_path(self) -> str:
        """Where the model came from (a checkpoint folder; ``<synthetic>`` for a fake)."""

    @property
    def tokenizer_path(self) -> str:
        """The tokenizer's folder (the model's, or the ``tokenizer`` engine argument's): its
        chat_template.jinja is the checkpoint's chat template."""
        return self.model_path

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """Default ``SamplingParams`` fields for requests that leave them unset (the
        checkpoint's generation_config.json as ``generation_config`` chooses; {}: none)."""
        return {}

    @property
    @abstractmethod
    def max_model_len(self) -> int:
        """Prompt plus generated tokens one request may hold."""

    @property
    def max_request_tokens(self) -> int:
        """Prompt plus generated tokens the engine admits for one request: at most
        ``max_model_len``, less when the KV pool holds fewer tokens (a request must fit
        in the whole pool). A front end defaults ``max_tokens`` to it and advertises it."""
        return self.max_model_len

    @property
    @abstractmethod
    def vocab_size(self) -> Optional[int]:
        """Token ids must be below this (a larger one would fail the whole batch's step);
        None when neither the model nor a tokenizer says."""

    @property
    @abstractmethod
    def max_logprobs(self) -> int:
        """The most log-probabilities a request may ask for per token."""

    @property
    @abstractmethod
    def eos_token_ids(self) -> list[int]:
        """The model's end-of-sequence token ids (beam search ends beams on them)."""

    @property
    @abstractmethod
    def tokenizer_config(self) -> dict[str, Any]:
        """The checkpoint's ``tokenizer_config.json`` ({} without one): the chat template
        and the special tokens it refers to."""

    @property
    def chat_template(self) -> Optional[Any]:
        """The raw ``chat_template`` entry (a string, or a list of named templates), or None."""
        return self.tokenizer_config.get("chat_template")

    # ---- text ----

    @property
    @abstractmethod
    def tokenizer(self) -> Optional[Any]:
        """The ``tokenizers.Tokenizer`` (None for a checkpoint without one). The front end
        owns it: tokenizing never waits for the engine."""

    @property
    @abstractmethod
    def token_bytes(self) -> Optional[Sequence[bytes]]:
        """Each token id's exact bytes (the engine's decode table), or None. Logprobs show
        them: a token may be half of a UTF-8 character."""

    @abstractmethod
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``InvalidRequestError`` without a tokenizer."""

    @abstractmethod
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids`` ("" without a tokenizer)."""

    # ---- health, figures, lifetime ----

    @abstractmethod
    def health(self) -> EngineHealth:
        """Dead or alive, steps finished and requests pending: cheap, called every
        watchdog tick."""

    @property
    def is_alive(self) -> bool:
        return self.health().alive

    @abstractmethod
    def thread_stacks(self) -> list[ThreadStack]:
        """The engine's threads (scheduler, executor, output) with their Python stacks
        now, for the stall watchdog's one dump."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """A snapshot of the engine's figures; ``EngineError`` once it is dead."""

    def engine_health(self) -> list[EngineHealth]:
        """``health`` of each engine core (several with data parallelism), by engine index."""
        return [self.health()]

    def engine_stats(self) -> dict[int, EngineStats]:
        """``stats`` of each engine core that can answer, keyed by its engine index
        (``/metrics`` labels the series with it): a dead core is left out, the others'
        figures stay. The default: one engine, index 0."""
        try:
            return {0: self.stats()}
        except EngineError:
            return {}

    @abstractmethod
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine; requests still running fail with ``EngineDeadError``."""


# ---- what both clients do the same way ----


async def normalize_off_loop(prompt: PromptType,
                             tokenize: Callable[[str], list[int]]) -> tuple[Optional[str], list[int]]:
    """``normalize_prompt`` for a caller on an event loop: a long text (over
    ``LONG_TEXT_CHARS``) is tokenized in a worker thread, with the GIL released
    (``encode_ids``), so the loop goes on serving the other streams meanwhile; token ids and
    short texts stay on the loop (a thread hop costs more than a sentence)."""
    text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
    if isinstance(text, str) and len(text) > LONG_TEXT_CHARS and not (
            isinstance(prompt, dict) and "prompt_token_ids" in prompt):
        return await asyncio.to_thread(normalize_prompt, prompt, tokenize)
    return normalize_prompt(prompt, tokenize)


async def until_finished(queue: asyncio.Queue[Union[Output, BaseException]],
                         abort: Callable[[], None]) -> AsyncIterator[Output]:
    """One request's outputs from ``queue`` up to its finished one; an error put there is
    raised. A consumer that stops first (``aclose``, or its task cancelled) gets ``abort``
    called: the engine stops working for nobody. Callers close this generator with
    ``contextlib.aclosing`` so that the abort happens at once, not when the garbage
    collector finds the generator."""
    finished = False
    try:
        while not finished:
            item = await queue.get()
            if isinstance(item, BaseException):
                finished = True
                raise item
            finished = item.finished
            yield item
    finally:
        if not finished:  # cancelled, or the consumer stopped early
            abort()


__all__ = ["EngineClient", "EngineHealth", "ThreadStack", "OutputKind", "normalize_off_loop", "until_finished"]
