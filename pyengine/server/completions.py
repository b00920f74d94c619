"""``POST /v1/completions``: text completions, streamed or whole."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Optional, Union

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from pyengine.server.choices import ChoiceDelta, ChoiceTracker
from pyengine.server.context import Context, ServerContext
from pyengine.server.errors import bad_request, to_api_error
from pyengine.server.generation import ClientDisconnected, GenerationSet
from pyengine.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from pyengine.server.sampling import check_length, sampling_params, tokenize_prompts
from pyengine.server.sse import DONE, error_event, event, sse_response
from pyengine.server.tokens import TokenText

router = APIRouter()


def completion_logprobs(tt: TokenText, token_ids: list[int], logprobs: list[dict[int, float]],
                        text_offset: int) -> CompletionLogprobs:
    """The legacy completions logprobs object for some generated tokens."""
    out = CompletionLogprobs()
    offset = text_offset
    for token, lps in zip(token_ids, logprobs):
        text = tt.text(token)
        out.tokens.append(text)
        out.token_logprobs.append(lps.get(token))
        out.top_logprobs.append({tt.text(t): v for t, v in sorted(lps.items(), key=lambda kv: -kv[1])})
        out.text_offset.append(offset)
        offset += tt.text_length(token)
    return out


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request,
                            ctx: Context) -> Union[Response, JSONResponse]:
    ctx.check_model(body.model)
    ctx.check_alive()
    if body.echo and body.logprobs is not None:
        raise bad_request("echo with logprobs is not supported (prompt logprobs are not computed)", "echo")
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of is not supported (it must equal n)", "best_of")
    params = sampling_params(ctx, body, max_tokens=body.max_tokens, logprobs=body.logprobs)
    prompts = tokenize_prompts(ctx, body.prompt, "prompt")
    for _, ids in prompts:
        check_length(ctx, len(ids), body.max_tokens, "prompt")
    request_id = ctx.new_id("cmpl")
    gen = GenerationSet(ctx.engine, [ids for _, ids in prompts], params, request_id)
    try:
        await gen.start(request)
    except Exception as error:  # noqa: BLE001 - refused by the engine: an error response
        raise to_api_error(error) from None
    tracker = ChoiceTracker(ctx, request_id, [len(ids) for _, ids in prompts], params.n)
    echoes = [(text if text is not None else ctx.token_text.decode(ids)) if body.echo else "" for text, ids in prompts]
    if body.stream:
        return sse_response(_stream(ctx, body, gen, tracker, echoes, [ids for _, ids in prompts]))
    try:
        async for index, out in gen.outputs():
            tracker.apply(index, out)
    except ClientDisconnected:
        ctx.metrics.disconnects.labels(ctx.args.model_name).inc()
        return Response(status_code=499)
    except Exception as error:  # noqa: BLE001 - the engine failed the request
        raise to_api_error(error) from None
    finally:
        gen.close()
    choices = []
    for choice in tracker.choices:
        p = choice.index // params.n
        lps = None
        if body.logprobs is not None:
            lps = completion_logprobs(ctx.token_text, choice.token_ids, choice.logprobs, len(echoes[p]))
        choices.append(CompletionChoice(
            index=choice.index, text=echoes[p] + choice.text, logprobs=lps, finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
            prompt_token_ids=prompts[p][1] if body.return_token_ids else None,
            token_ids=choice.token_ids if body.return_token_ids else None,
        ))
    response = CompletionResponse(id=request_id, model=ctx.args.model_name, choices=choices, usage=tracker.usage())
    return JSONResponse(response.model_dump())


async def _stream(ctx: ServerContext, body: CompletionRequest, gen: GenerationSet, tracker: ChoiceTracker,
                  echoes: list[str], prompt_ids: list[list[int]]) -> AsyncIterator[bytes]:
    created = int(time.time())
    n = tracker.n

    def chunk(index: int, text: str, delta: Optional[ChoiceDelta] = None, first: bool = False) -> bytes:
        lps = None
        if delta is not None and body.logprobs is not None:
            lps = completion_logprobs(ctx.token_text, delta.token_ids, delta.logprobs,
                                      len(echoes[index // n]) + delta.text_offset)
        choice = CompletionChoice(
            index=index, text=text, logprobs=lps,
            finish_reason=delta.finish_reason if delta is not None else None,
            stop_reason=delta.choice.stop_reason if delta is not None and delta.finish_reason else None,
            prompt_token_ids=prompt_ids[index // n] if first and body.return_token_ids else None,
            token_ids=delta.token_ids if delta is not None and body.return_token_ids else None,
        )
        return event(CompletionResponse(id=gen.request_id, created=created, model=ctx.args.model_name,
                                        choices=[choice]))

    try:
        if body.echo or body.return_token_ids:
            for choice in tracker.choices:
                yield chunk(choice.index, echoes[choice.index // n], first=True)
        async for index, out in gen.outputs():
            for delta in tracker.apply(index, out):
                yield chunk(delta.choice.index, delta.text, delta)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield event(CompletionResponse(id=gen.request_id, created=created, model=ctx.args.model_name,
                                           choices=[], usage=tracker.usage()))
        yield DONE
    except ClientDisconnected:
        ctx.metrics.disconnects.labels(ctx.args.model_name).inc()
    except asyncio.CancelledError:
        ctx.metrics.disconnects.labels(ctx.args.model_name).inc()
        raise
    except Exception as error:  # noqa: BLE001 - reported in the stream
        yield error_event(to_api_error(error))
        yield DONE
    finally:
        gen.close()
