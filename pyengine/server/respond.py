"""The shared life of a generating request (``/v1/completions``, ``/v1/chat/completions``).

Both endpoints start their engine requests the same way, collect a whole response the
same way and end a stream the same way (usage chunk, ``[DONE]``, a disconnect counted,
a failure as an error event); only how a choice is spelled differs. That sameness lives
here, once, so that the two endpoints cannot drift apart in how they fail.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from typing import Callable, Optional

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from pyengine.sampling_params import SamplingParams
from pyengine.server.choices import ChoiceDelta, ChoiceTracker
from pyengine.server.context import ServerContext
from pyengine.server.engine_requests import ClientDisconnected, EngineRequests
from pyengine.server.errors import APIError, to_api_error
from pyengine.server.protocol import SamplingFields
from pyengine.server.sse import DONE, error_event, event, sse_response

# Builds the chunk model (``CompletionResponse`` / ``ChatCompletionChunk``) from its fields.
ChunkType = Callable[..., BaseModel]


def wants_usage(body: SamplingFields) -> bool:
    """``stream_options.include_usage``: a last chunk with the usage and no choices."""
    return body.stream_options is not None and body.stream_options.include_usage


class ResponseRun:
    """One completion or chat response in progress: its ``EngineRequests`` and the choices
    they feed, collected whole or streamed."""

    def __init__(self, ctx: ServerContext, requests: EngineRequests, tracker: ChoiceTracker) -> None:
        self.ctx = ctx
        self.requests = requests
        self.tracker = tracker

    @classmethod
    async def start(cls, ctx: ServerContext, request: Request, prompts: list[list[int]], params: SamplingParams,
                    request_id: str) -> ResponseRun:
        """Submits every prompt; a request the engine refuses is an error response (before
        anything is sent, so a 400 rather than a broken stream)."""
        requests = EngineRequests(ctx.engine_client, prompts, params, request_id)
        try:
            await requests.start(request)
        except ClientDisconnected:  # while a constrained request was compiled: nobody reads this
            ctx.metrics.disconnects.labels(ctx.args.model_name).inc()
            raise APIError(499, "the client disconnected") from None
        except Exception as error:  # noqa: BLE001 - refused by the engine: an error response
            raise to_api_error(error) from None
        return cls(ctx, requests, ChoiceTracker(ctx, request_id, [len(ids) for ids in prompts], params.n))

    async def collect(self) -> Optional[Response]:
        """Feeds every output to the tracker (its choices are then complete). Returns a 499
        when the client went away (nobody reads it: it only ends the handler), else None."""
        try:
            async for index, out in self.requests.outputs():
                self.tracker.apply(index, out)
        except ClientDisconnected:
            self._count_disconnect()
            return Response(status_code=499)
        except Exception as error:  # noqa: BLE001 - the engine failed the request
            raise to_api_error(error) from None
        finally:
            self.requests.close()
        return None

    def stream(self, chunk_type: ChunkType, head: Iterable[BaseModel],
               delta: Callable[[ChoiceDelta], Optional[BaseModel]], usage: bool) -> StreamingResponse:
        """An SSE response: one chunk per choice in ``head`` (iterated once the stream
        runs), then one per ``delta`` as outputs come (None: nothing to send for that
        one), then the usage chunk (if ``usage``) and ``[DONE]``. A failure mid-stream is
        an error event, then ``[DONE]``."""
        return sse_response(self._events(chunk_type, head, delta, usage))

    async def _events(self, chunk_type: ChunkType, head: Iterable[BaseModel],
                      delta: Callable[[ChoiceDelta], Optional[BaseModel]], usage: bool) -> AsyncIterator[bytes]:
        created = int(time.time())
        request_id, model = self.requests.request_id, self.ctx.args.model_name
        try:
            for choice in head:
                yield event(chunk_type(id=request_id, created=created, model=model, choices=[choice]))
            async for index, out in self.requests.outputs():
                for d in self.tracker.apply(index, out):
                    choice = delta(d)
                    if choice is not None:
                        yield event(chunk_type(id=request_id, created=created, model=model, choices=[choice]))
            if usage:
                yield event(chunk_type(id=request_id, created=created, model=model, choices=[],
                                       usage=self.tracker.usage()))
            yield DONE
        except ClientDisconnected:
            self._count_disconnect()
        except asyncio.CancelledError:
            self._count_disconnect()
            raise
        except Exception as error:  # noqa: BLE001 - reported in the stream
            yield error_event(to_api_error(error))
            yield DONE
        finally:
            self.requests.close()

    def _count_disconnect(self) -> None:
        self.ctx.metrics.disconnects.labels(self.ctx.args.model_name).inc()
