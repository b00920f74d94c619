"""``EngineClient.beam_search``'s body: beam search over any engine client (in-process or
in another process), each step's beams as concurrent one-token requests.

Used by the server (``use_beam_search``). The steps are ordinary requests, so a search
shares the engine with other clients' requests as their peers; cancelling the search
(a client that went away) aborts the step's requests, which frees their blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

from pyengine.beam_search.driver import (
    Batch,
    Candidates,
    candidates_of,
    check_params,
    finish,
    make_searches,
    search_steps,
)
from pyengine.beam_search.outputs import BeamSearchOutput
from pyengine.beam_search.params import BeamSearchParams
from pyengine.errors import EngineError
from pyengine.inputs.prompts import PromptType
from pyengine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pyengine.entrypoints.engine_client import EngineClient


async def beam_search(engine: EngineClient, prompts: Sequence[PromptType], params: BeamSearchParams,
                      request_id: str) -> list[BeamSearchOutput]:
    """One ``BeamSearchOutput`` per prompt; engine requests are ``{request_id}-{step}-{i}``.
    Raises ``InvalidRequestError`` before any step for a search the engine cannot run."""
    eos = list(engine.eos_token_ids)
    check_params(params, engine.max_logprobs, len(eos))
    texts, searches = make_searches(prompts, params, engine.tokenize, eos, engine.max_request_tokens)
    steps = search_steps(searches)
    try:
        batch: Optional[Batch] = next(steps)
    except StopIteration:
        batch = None
    step = 0
    while batch is not None:
        results = await _run_batch(engine, batch, f"{request_id}-{step}")
        step += 1
        try:
            batch = steps.send(results)
        except StopIteration:
            batch = None

    def decode(ids: list[int]) -> str:
        return engine.decode(ids, skip_special_tokens=False)

    return finish(searches, texts, decode)


async def _run_batch(engine: EngineClient, batch: Batch, prefix: str) -> list[Candidates]:
    """The step's requests, all submitted at once; the first failure (or a cancellation)
    cancels the others, which aborts their engine requests."""
    sequences, params = batch
    tasks = [asyncio.ensure_future(_one(engine, ids, params, f"{prefix}-{i}")) for i, ids in enumerate(sequences)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()


async def _one(engine: EngineClient, ids: list[int], params: SamplingParams, request_id: str) -> Candidates:
    last = None
    async for out in engine.generate({"prompt_token_ids": ids}, params, request_id,
                                     output_kind="final"):
        last = out
    if last is None:
        raise EngineError(f"beam-search request {request_id} ended without an output")
    return candidates_of(last)
