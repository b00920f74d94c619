"""``POST /v1/completions``: text completions, streamed or whole."""

from __future__ import annotations

from typing import Optional, Union

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from pyengine.logprobs import SampleLogprobs
from pyengine.server.beam_search import beam_search_completion
from pyengine.server.choices import ChoiceDelta
from pyengine.server.context import Context, ServerContext
from pyengine.server.errors import APIError, bad_request
from pyengine.server.offload import off_the_loop_if_long, text_size
from pyengine.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from pyengine.server.respond import Generation, wants_usage
from pyengine.server.sampling import check_length, default_max_tokens, sampling_params, tokenize_prompts
from pyengine.server.structured import name_constraint_error, structured_outputs_params
from pyengine.server.tokens import TokenText

router = APIRouter()


def completion_logprobs(tt: TokenText, token_ids: list[int], logprobs: SampleLogprobs,
                        text_offset: int) -> CompletionLogprobs:
    """The legacy completions logprobs object for some generated tokens."""
    out = CompletionLogprobs()
    offset = text_offset
    for token, lps in zip(token_ids, logprobs):
        text = tt.text(token)
        out.tokens.append(text)
        chosen = lps.get(token)
        out.token_logprobs.append(chosen.logprob if chosen is not None else None)
        out.top_logprobs.append({tt.text(t): v.logprob for t, v in sorted(lps.items(), key=lambda kv: -kv[1].logprob)})
        out.text_offset.append(offset)
        offset += tt.text_length(token)
    return out


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request,
                            ctx: Context) -> Union[Response, JSONResponse]:
    ctx.check_model(body.model)
    ctx.check_alive()
    if body.use_beam_search:
        return await beam_search_completion(ctx, body, request)
    if body.echo and body.logprobs is not None:
        raise bad_request("echo with logprobs is not supported (prompt logprobs are not computed)", "echo")
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of is not supported (it must equal n)", "best_of")
    constraint, constraint_param = structured_outputs_params(body)
    params = sampling_params(ctx, body, max_tokens=body.max_tokens, logprobs=body.logprobs,  # field checks first
                             structured_outputs=constraint)
    prompts = await off_the_loop_if_long(text_size(body.prompt), tokenize_prompts, ctx, body.prompt, "prompt")
    for _, ids in prompts:
        check_length(ctx, len(ids), body.max_tokens, "prompt")
    if params.max_tokens is None:  # null: what the longest prompt leaves (not the engine's guess)
        params.max_tokens = default_max_tokens(ctx, [len(ids) for _, ids in prompts])
    prompt_ids = [ids for _, ids in prompts]
    try:
        run = await Generation.start(ctx, request, prompt_ids, params, ctx.new_id("cmpl"))
    except APIError as error:  # a schema, regex or grammar the engine cannot compile: named as sent
        raise name_constraint_error(error, constraint_param) from None
    echoes = [(text if text is not None else ctx.token_text.decode(ids)) if body.echo else "" for text, ids in prompts]
    if body.stream:
        return _stream(ctx, body, run, echoes, prompt_ids)
    gone = await run.collect()
    if gone is not None:
        return gone
    choices = []
    for choice in run.tracker.choices:
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
    response = CompletionResponse(id=run.gen.request_id, model=ctx.args.model_name, choices=choices,
                                  usage=run.tracker.usage())
    return JSONResponse(response.model_dump())


def _stream(ctx: ServerContext, body: CompletionRequest, run: Generation, echoes: list[str],
            prompt_ids: list[list[int]]) -> StreamingResponse:
    """With ``echo`` or ``return_token_ids``, a first chunk per choice carries the prompt;
    then text deltas."""
    n = run.tracker.n

    def choice(index: int, text: str, delta: Optional[ChoiceDelta] = None, first: bool = False) -> CompletionChoice:
        lps = None
        if delta is not None and body.logprobs is not None:
            lps = completion_logprobs(ctx.token_text, delta.token_ids, delta.logprobs,
                                      len(echoes[index // n]) + delta.text_offset)
        return CompletionChoice(
            index=index, text=text, logprobs=lps,
            finish_reason=delta.finish_reason if delta is not None else None,
            stop_reason=delta.choice.stop_reason if delta is not None and delta.finish_reason else None,
            prompt_token_ids=prompt_ids[index // n] if first and body.return_token_ids else None,
            token_ids=delta.token_ids if delta is not None and body.return_token_ids else None,
        )

    head = (choice(c.index, echoes[c.index // n], first=True) for c in run.tracker.choices
            if body.echo or body.return_token_ids)
    return run.stream(CompletionResponse, head, lambda d: choice(d.choice.index, d.text, d), usage=wants_usage(body))
