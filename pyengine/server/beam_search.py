"""``use_beam_search`` on ``POST /v1/completions`` (vLLM's extra field): ``n`` beams per
prompt, returned as ``n`` choices per prompt, best first.

The search runs through the engine client (``EngineClient.beam_search``): each step's beams
are ordinary one-token requests, peers of every other client's. The answer is known only
when the search ends, so streaming is refused; so are the sampling fields a beam search
does not use (``stop``, ``top_p``, ...), each by name, rather than silently ignored.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from pyengine.beam_search.params import BeamSearchParams
from pyengine.errors import InvalidRequestError
from pyengine.server.context import ServerContext
from pyengine.server.errors import bad_request, to_api_error
from pyengine.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo
from pyengine.server.sampling import check_length, default_max_tokens, tokenize_prompts
from pyengine.server.structured import requested_constraint

#: Request fields a beam search has no use for, and the value that means "not set".
_UNUSED = {"top_p": None, "top_k": None, "min_p": None, "repetition_penalty": None, "presence_penalty": None,
           "frequency_penalty": None, "stop": None, "stop_token_ids": None, "min_tokens": 0, "logprobs": None,
           "logit_bias": None, "suffix": None}
#: BeamSearchParams' names -> the request's.
_RENAMES = {"beam_width": "n"}


def beam_search_params(ctx: ServerContext, body: CompletionRequest, max_tokens: int) -> BeamSearchParams:
    """The search ``body`` asks for; a 400 naming the field it cannot have."""
    if body.stream:
        raise bad_request("stream is not supported with use_beam_search: the beams are known only when the search "
                          "ends; send stream=false", "stream")
    for name, unset in _UNUSED.items():
        if getattr(body, name) not in (unset, None):
            raise bad_request(f"{name} is not supported with use_beam_search", name)
    constraint = requested_constraint(body)
    if constraint is not None:
        raise bad_request(f"{constraint.param} is not supported with use_beam_search", constraint.param)
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of must equal n (the beam width) with use_beam_search", "best_of")
    if body.n > ctx.args.max_n:
        raise bad_request(f"n must be <= {ctx.args.max_n}, got {body.n}", "n")
    try:
        params = BeamSearchParams(
            beam_width=body.n, max_tokens=max_tokens, ignore_eos=body.ignore_eos,
            temperature=body.temperature if body.temperature is not None else 0.0,
            length_penalty=body.length_penalty, include_stop_str_in_output=body.include_stop_str_in_output,
            early_stopping=body.early_stopping,
        )
    except InvalidRequestError as error:
        raise _named(error) from None
    return params


async def beam_search_completion(ctx: ServerContext, body: CompletionRequest, request: Request) -> Response:
    """The whole ``/v1/completions`` answer for a ``use_beam_search`` request."""
    if body.max_tokens is not None:
        beam_search_params(ctx, body, body.max_tokens)  # the fields first, as for sampling
    prompts = tokenize_prompts(ctx, body.prompt, "prompt")
    for _, ids in prompts:
        check_length(ctx, len(ids), body.max_tokens, "prompt")
    max_tokens = body.max_tokens if body.max_tokens is not None else \
        default_max_tokens(ctx, [len(ids) for _, ids in prompts])
    params = beam_search_params(ctx, body, max_tokens)
    request_id = ctx.new_id("cmpl")
    search = asyncio.ensure_future(ctx.engine.beam_search([{"prompt_token_ids": ids} for _, ids in prompts],
                                                          params, request_id))
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({search, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not search.done():  # the client left (or this handler was cancelled): abort the step's requests
            search.cancel()
    if not search.done() or search.cancelled():
        ctx.metrics.disconnects.labels(ctx.args.model_name).inc()
        return Response(status_code=499)
    error = search.exception()
    if error is not None:
        raise _named(error) if isinstance(error, InvalidRequestError) else to_api_error(error)
    choices = []
    completion_tokens = 0
    for p, (out, (text, ids)) in enumerate(zip(search.result(), prompts)):
        echo = (text if text is not None else ctx.token_text.decode(ids)) if body.echo else ""
        for j, seq in enumerate(out.sequences):
            generated = seq.output_token_ids
            completion_tokens += len(generated)
            choices.append(CompletionChoice(
                index=p * body.n + j, text=echo + (seq.text or ""), finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                prompt_token_ids=ids if body.return_token_ids else None,
                token_ids=generated if body.return_token_ids else None,
            ))
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                      total_tokens=prompt_tokens + completion_tokens)
    response = CompletionResponse(id=request_id, model=ctx.args.model_name, choices=choices, usage=usage)
    return JSONResponse(response.model_dump())


def _named(error: InvalidRequestError) -> Exception:
    """A 400 whose ``param`` is the request's name for the field the message starts with."""
    message = str(error)
    field: Optional[str] = message.split(" ", 1)[0]
    if field in _RENAMES:
        message = _RENAMES[field] + message[len(field):]
        field = _RENAMES[field]
    return bad_request(message, field if field in _FIELDS else None)


_FIELDS = frozenset({"n", "max_tokens", "temperature", "length_penalty", "early_stopping", "ignore_eos", "prompt"})


async def _disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
