"""``POST /v1/responses``, ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``
(vLLM's routes): OpenAI's Responses API on the chat endpoint's machinery (``prepare.py``),
one choice per response.

``previous_response_id`` continues a stored response (``store.py``); an id the store
does not hold (never stored, ``store=false``, or evicted) is a 404 in OpenAI's shape, with
vLLM's message. vLLM keeps responses only when ``VLLM_ENABLE_RESPONSES_API_STORE`` is set
(and then without bound); here the store is on by default and bounded
(``--responses-store-size``, ``--responses-store-max-bytes``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Optional, Union

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from pyengine.server.context import Context, ServerContext
from pyengine.server.engine_requests import ClientDisconnected
from pyengine.server.errors import APIError, bad_request, to_api_error
from pyengine.server.respond import ResponseRun
from pyengine.server.responses.conversation import Conversation, conversation, output_messages
from pyengine.server.responses.events import EventWriter, StreamedOutput
from pyengine.server.responses.output import output_items, response_object, status_of, usage
from pyengine.server.responses.prepare import Prepared, prepare
from pyengine.server.responses.protocol import ResponseError, ResponseObject, ResponsesRequest, ResponseUsage
from pyengine.server.responses.unsupported import check_supported
from pyengine.server.sse import sse_response
from pyengine.server.structured import name_constraint_error

router = APIRouter()


def not_found(response_id: str, param: str) -> APIError:
    """vLLM's 404 for a response id the store does not hold."""
    return APIError(404, f"Response with id '{response_id}' not found.", param, "response_not_found")


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request, ctx: Context) -> Union[Response, JSONResponse]:
    ctx.check_model(body.model)
    ctx.check_alive()
    check_supported(body)
    history = None
    if body.previous_response_id is not None:
        stored = ctx.responses.get(body.previous_response_id)
        if stored is None:
            raise not_found(body.previous_response_id, "previous_response_id")
        history = stored.history
    conv = conversation(body, history)
    prepared = await prepare(ctx, body, conv)
    response_id = ctx.new_id("resp").replace("-", "_", 1)
    try:
        run = await ResponseRun.start(ctx, request, [prepared.prompt_ids], prepared.params, response_id)
    except APIError as error:  # a schema the engine cannot compile: named as sent
        raise name_constraint_error(error, prepared.constraint_param) from None
    created_at = time.time()
    if body.stream:
        return sse_response(_events(ctx, body, run, prepared, conv, response_id, created_at))
    gone = await run.collect()
    if gone is not None:
        return gone
    choice = run.tracker.choices[0]
    status, incomplete = status_of(choice.finish_reason)
    response = response_object(body, response_id, ctx.args.model_name, created_at, status,
                               output=output_items(prepared.plan, choice.text), usage=_usage(run, prepared),
                               incomplete_details=incomplete)
    _store(ctx, body, response, conv)
    return JSONResponse(response.model_dump())


@router.get("/v1/responses/{response_id}", response_model=None)
async def retrieve_response(response_id: str, ctx: Context, stream: Optional[bool] = None) -> Response:
    """A stored response, as it was returned."""
    if stream:
        raise bad_request("stream=true replays a background response's events; this server runs no background "
                          "responses, so a stored response can only be fetched whole", "stream",
                          "unsupported_parameter")
    stored = ctx.responses.get(response_id)
    if stored is None:
        raise not_found(response_id, "response_id")
    return Response(stored.response_json, media_type="application/json")


@router.post("/v1/responses/{response_id}/cancel", response_model=None)
async def cancel_response(response_id: str, ctx: Context) -> JSONResponse:
    """vLLM's answers: a stored response is one that already finished within its request
    (there are no background responses to cancel), a 400; an unknown id, a 404."""
    if ctx.responses.get(response_id) is None:
        raise not_found(response_id, "response_id")
    raise bad_request("Cannot cancel a synchronous response.", "response_id")


def _usage(run: ResponseRun, prepared: Prepared) -> ResponseUsage:
    return usage(len(prepared.prompt_ids), len(run.tracker.choices[0].token_ids), run.tracker.cached_tokens)


def _store(ctx: ServerContext, body: ResponsesRequest, response: ResponseObject, conv: Conversation) -> None:
    if body.store:
        ctx.responses.put(response.id, response.model_dump(), conv.history() + output_messages(response.output))


async def _events(ctx: ServerContext, body: ResponsesRequest, run: ResponseRun, prepared: Prepared,
                  conv: Conversation, response_id: str, created_at: float) -> AsyncIterator[bytes]:
    writer = EventWriter()
    output = StreamedOutput(prepared.plan, writer)
    model = ctx.args.model_name

    def snapshot(status: str, **fields) -> dict:
        return response_object(body, response_id, model, created_at, status, **fields).model_dump()

    try:
        yield writer.emit("response.created", response=snapshot("in_progress"))
        yield writer.emit("response.in_progress", response=snapshot("in_progress"))
        async for index, out in run.requests.outputs():
            for d in run.tracker.apply(index, out):
                for event in output.feed(d.text, d.finish_reason is not None):
                    yield event
        for event in output.close():
            yield event
        status, incomplete = status_of(run.tracker.choices[0].finish_reason)
        final = response_object(body, response_id, model, created_at, status,
                                output=output.final_items(run.tracker.choices[0].text),
                                usage=_usage(run, prepared), incomplete_details=incomplete)
        _store(ctx, body, final, conv)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield writer.emit(kind, response=final.model_dump())
    except ClientDisconnected:
        _count_disconnect(ctx)
    except asyncio.CancelledError:
        _count_disconnect(ctx)
        raise
    except Exception as error:  # noqa: BLE001 - reported in the stream
        api = to_api_error(error)
        failed = snapshot("failed", output=output.items,
                          error=ResponseError(code=api.code or api.type, message=api.message))
        yield writer.emit("response.failed", response=failed)
    finally:
        run.requests.close()


def _count_disconnect(ctx: ServerContext) -> None:
    ctx.metrics.disconnects.labels(ctx.args.model_name).inc()
