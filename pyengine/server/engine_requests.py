"""``EngineRequests``: the engine requests behind one HTTP request, run together.

A completion with several prompts is one engine request per prompt; their outputs are
merged into one stream of ``(prompt_index, RequestOutput)``. Engine requests are started
eagerly so that a request the engine refuses raises *before* a response is sent (a 400,
not a broken stream). If the client disconnects, every engine request is aborted (its
KV blocks are freed) and the consumer gets ``ClientDisconnected``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Optional, Union

from starlette.requests import Request

from pyengine.entrypoints.engine_client import EngineClient
from pyengine.outputs import RequestOutput
from pyengine.sampling_params import SamplingParams


class ClientDisconnected(Exception):
    """The HTTP client went away; its engine requests were aborted."""


_Item = Union[tuple[int, RequestOutput], BaseException]


class EngineRequests:
    """Engine requests ``{request_id}-{i}`` for each prompt ``i``, consumed together."""

    def __init__(self, engine: EngineClient, prompts: Sequence[list[int]], params: SamplingParams,
                 request_id: str) -> None:
        self.engine_client = engine
        self.prompts = list(prompts)
        self.params = params
        self.request_id = request_id
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._watcher: Optional[asyncio.Task[None]] = None
        self._unfinished = len(self.prompts)
        self.disconnected = False
        self.started_at = time.time()

    def engine_id(self, index: int) -> str:
        return self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{index}"

    async def start(self, request: Optional[Request] = None) -> None:
        """Submits every prompt; raises the engine's error if one is refused (and aborts
        the others). With ``request``, a client disconnect aborts the set.

        Most refusals happen in ``add_request``, which a pump reaches before its first
        wait. A constrained request's constraint is compiled first: ``engine.prepare``
        does that here, off the event loop, and raises its refusal. An engine that
        compiles elsewhere (another process: ``prepare`` does nothing) refuses later, so
        for a constrained request each pump's first output or error is awaited too: an
        invalid schema is a 400, never a 200 stream that ends in an error."""
        await self.engine_client.prepare(self.params)  # a constraint compiled off the loop, before any pump
        for i, ids in enumerate(self.prompts):
            self._tasks.append(asyncio.ensure_future(self._pump(i, ids)))
        if request is not None:
            self._watcher = asyncio.ensure_future(self._watch(request))
        await asyncio.sleep(0)  # each pump runs up to its first wait: add_request has run
        early: list[_Item] = []
        heard: set[int] = set()
        while not self._queue.empty() or (self.params.structured_outputs is not None
                                          and len(heard) < len(self.prompts)):
            item = await self._queue.get()
            early.append(item)
            if isinstance(item, BaseException):
                self.close()
                raise item
            heard.add(item[0])
        for item in early:
            self._queue.put_nowait(item)

    async def _pump(self, index: int, prompt_token_ids: list[int]) -> None:
        try:
            async for out in self.engine_client.generate(
                {"prompt_token_ids": prompt_token_ids}, self.params, self.engine_id(index), output_kind="delta"
            ):
                self._queue.put_nowait((index, out))
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # noqa: BLE001 - handed to the consumer
            self._queue.put_nowait(error)

    async def _watch(self, request: Request) -> None:
        await wait_disconnect(request)
        self.disconnected = True
        for task in self._tasks:
            task.cancel()
        self._queue.put_nowait(ClientDisconnected(f"client disconnected from {self.request_id}"))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs (deltas) as they come, until every engine request has finished."""
        while self._unfinished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item[1].finished:
                self._unfinished -= 1
            yield item

    def close(self) -> None:
        """Aborts whatever still runs and stops watching the client. Synchronous, so that
        it also works in a ``finally`` of a stream that is being cancelled: each cancelled
        pump aborts its engine request as it unwinds."""
        if self._watcher is not None:
            self._watcher.cancel()
        for task in self._tasks:
            if not task.done():
                task.cancel()


async def wait_disconnect(request: Request) -> None:
    """Returns when the client of ``request`` disconnects (its body already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
