"""``use_beam_search`` (vLLM's extra field) on ``POST /v1/completions`` and
``POST /v1/chat/completions``: ``n`` beams per prompt, returned as ``n`` choices per
prompt, best first.

The search runs through the engine client (``EngineClient.beam_search``): each step's beams
are ordinary one-token requests, peers of every other client's. The answer is known only
when the search ends, so streaming is refused; so are the sampling fields a beam search
does not use (``stop``, ``top_p``, ...), each by name, rather than silently ignored.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any, Optional, Union

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from pyengine.beam_search.outputs import BeamSearchOutput
from pyengine.beam_search.params import BeamSearchParams
from pyengine.errors import InvalidRequestError
from pyengine.server.context import ServerContext
from pyengine.server.engine_requests import wait_disconnect
from pyengine.server.errors import bad_request, from_value_error, to_api_error
from pyengine.server.offload import off_the_loop_if_long, text_size
from pyengine.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    SamplingFields,
    UsageInfo,
)
from pyengine.server.sampling import check_length, default_max_tokens, tokenize_prompts
from pyengine.server.structured import requested_constraint
from pyengine.server.tools import ToolPlan, whole_message

#: Request fields a beam search has no use for, and the values that change nothing (clients
#: that send every field send these): anything else is refused by name.
_UNUSED: dict[str, tuple[Any, ...]] = {
    "top_p": (None, 1.0), "top_k": (None, 0, -1), "min_p": (None, 0.0), "repetition_penalty": (None, 1.0),
    "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0), "stop": (None, [], ""),
    "stop_token_ids": (None, []), "min_tokens": (0,), "logit_bias": (None, {}),
    "allowed_token_ids": (None,), "bad_words": (None, []), "truncate_prompt_tokens": (None,),
}
_UNUSED_COMPLETIONS = {**_UNUSED, "logprobs": (None,), "suffix": (None, ""), "prompt_logprobs": (None,)}
_UNUSED_CHAT = {**_UNUSED, "logprobs": (False,), "top_logprobs": (None,), "prompt_logprobs": (None,)}
#: BeamSearchParams' names that the request spells otherwise.
_RENAMES = {"beam_width": "n"}


def beam_search_params(ctx: ServerContext, body: SamplingFields, max_tokens: int,
                       unused: Mapping[str, tuple[Any, ...]],
                       tokens_param: str = "max_tokens") -> BeamSearchParams:
    """The search ``body`` asks for; a 400 naming the field it cannot have."""
    if body.stream:
        raise bad_request("stream is not supported with use_beam_search: the beams are known only when the search "
                          "ends; send stream=false", "stream")
    for name, neutral in unused.items():
        if getattr(body, name) not in neutral:
            raise bad_request(f"{name} is not supported with use_beam_search", name)
    constraint = requested_constraint(body)
    if constraint is not None:
        raise bad_request(f"{constraint.param} is not supported with use_beam_search", constraint.param)
    if body.n > ctx.args.max_n:
        raise bad_request(f"n must be <= {ctx.args.max_n}, got {body.n}", "n")
    try:
        return BeamSearchParams(
            beam_width=body.n, max_tokens=max_tokens, ignore_eos=body.ignore_eos,
            temperature=body.temperature if body.temperature is not None else 0.0,
            length_penalty=body.length_penalty, include_stop_str_in_output=body.include_stop_str_in_output,
            early_stopping=body.early_stopping,
        )
    except InvalidRequestError as error:
        raise from_value_error(error, {**_RENAMES, "max_tokens": tokens_param}) from None


async def beam_search_completion(ctx: ServerContext, body: CompletionRequest, request: Request) -> Response:
    """The whole ``/v1/completions`` answer for a ``use_beam_search`` request."""
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of must equal n (the beam width) with use_beam_search", "best_of")
    if body.max_tokens is not None:
        beam_search_params(ctx, body, body.max_tokens, _UNUSED_COMPLETIONS)  # the fields first, as for sampling
    prompts = await off_the_loop_if_long(text_size(body.prompt), tokenize_prompts, ctx, body.prompt, "prompt")
    for _, ids in prompts:
        check_length(ctx, len(ids), body.max_tokens, "prompt")
    max_tokens = body.max_tokens if body.max_tokens is not None else \
        default_max_tokens(ctx, [len(ids) for _, ids in prompts])
    params = beam_search_params(ctx, body, max_tokens, _UNUSED_COMPLETIONS)
    request_id = ctx.new_id("cmpl")
    found = await run_search(ctx, request, [ids for _, ids in prompts], params, request_id, {})
    if isinstance(found, Response):
        return found
    choices = []
    for p, (out, (text, ids)) in enumerate(zip(found, prompts)):
        echo = (text if text is not None else ctx.token_text.decode(ids)) if body.echo else ""
        for j, seq in enumerate(out.sequences):
            choices.append(CompletionChoice(
                index=p * body.n + j, text=echo + (seq.text or ""), finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                prompt_token_ids=ids if body.return_token_ids else None,
                token_ids=seq.output_token_ids if body.return_token_ids else None,
            ))
    response = CompletionResponse(id=request_id, model=ctx.args.model_name, choices=choices, usage=_usage(found))
    return JSONResponse(response.model_dump())


def check_chat(ctx: ServerContext, body: ChatCompletionRequest, plan: ToolPlan, max_tokens: Optional[int],
               tokens_param: str) -> None:
    """The fields of a chat ``use_beam_search`` request, before its prompt is rendered."""
    if plan.grammar is not None:
        raise bad_request("a forced tool_choice is not supported with use_beam_search (it constrains the answer)",
                          "tool_choice")
    if max_tokens is not None:
        beam_search_params(ctx, body, max_tokens, _UNUSED_CHAT, tokens_param)


async def beam_search_chat(ctx: ServerContext, body: ChatCompletionRequest, request: Request, plan: ToolPlan,
                           prompt_ids: list[int], max_tokens: Optional[int], tokens_param: str) -> Response:
    """The whole ``/v1/chat/completions`` answer for a ``use_beam_search`` request whose
    prompt is rendered (``prompt_ids``): each beam's text as the assistant's message
    (tool calls parsed from it as for a sampled answer)."""
    if max_tokens is None:
        max_tokens = default_max_tokens(ctx, [len(prompt_ids)])
    params = beam_search_params(ctx, body, max_tokens, _UNUSED_CHAT, tokens_param)
    request_id = ctx.new_id("chatcmpl")
    found = await run_search(ctx, request, [prompt_ids], params, request_id, {"prompt": "messages"})
    if isinstance(found, Response):
        return found
    choices = []
    for j, seq in enumerate(found[0].sequences):
        message, finish_reason = whole_message(plan, seq.text or "", seq.finish_reason)
        choices.append(ChatChoice(index=j, message=message, finish_reason=finish_reason, stop_reason=seq.stop_reason,
                                  token_ids=seq.output_token_ids if body.return_token_ids else None))
    response = ChatCompletionResponse(id=request_id, model=ctx.args.model_name, choices=choices, usage=_usage(found),
                                      prompt_token_ids=prompt_ids if body.return_token_ids else None)
    return JSONResponse(response.model_dump())


async def run_search(ctx: ServerContext, request: Request, prompts: list[list[int]], params: BeamSearchParams,
                     request_id: str, renames: Mapping[str, str]) -> Union[list[BeamSearchOutput], Response]:
    """The search's outputs, or a 499 when the client left first (the search is then
    cancelled, which aborts its step's requests). Errors are API errors naming the
    request's field (``renames``: ours -> the request's)."""
    started = time.time()
    search = asyncio.ensure_future(ctx.engine_client.beam_search([{"prompt_token_ids": ids} for ids in prompts], params,
                                                          request_id))
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({search, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        left = not search.done()  # the client left (or this handler was cancelled)
        if left:
            # cancel() only asks: the search ends (its step's requests aborted) at its
            # next await, so it is awaited before anything reads its state.
            search.cancel()
            await asyncio.gather(search, return_exceptions=True)
    if left:
        ctx.metrics.disconnects.labels(ctx.args.model_name).inc()
        return Response(status_code=499)
    error = search.exception()
    if error is not None:
        raise from_value_error(error, {**_RENAMES, **renames}) if isinstance(error, InvalidRequestError) \
            else to_api_error(error)
    found = search.result()
    # /metrics: the search's sequences and its latency (the step requests inside it are the
    # engine's business: they show in its token and prefix-cache counters).
    model = ctx.args.model_name
    for sequence in (s for out in found for s in out.sequences):
        ctx.metrics.success.labels(model, sequence.finish_reason or "unknown").inc()
    ctx.metrics.e2e.labels(model).observe(time.time() - started)
    return found


def _usage(outputs: list[BeamSearchOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(s.output_token_ids) for o in outputs for s in o.sequences)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
