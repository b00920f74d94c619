"""``POST /v1/completions``: text completions, streamed or whole."""

from __future__ import annotations

from typing import Optional, Union

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from pyengine.logprob_arrays import LogprobArrays
from pyengine.server.beam_search import beam_search_completion
from pyengine.server.choices import ChoiceDelta
from pyengine.server.context import Context, ServerContext
from pyengine.server.errors import APIError, bad_request
from pyengine.server.offload import off_the_loop_if_long, text_size
from pyengine.server.prompt_logprobs import prompt_logprobs_json
from pyengine.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from pyengine.server.respond import ResponseRun, wants_usage
from pyengine.server.sampling import (
    check_length,
    default_max_tokens,
    sampling_params,
    tokenize_prompts,
    truncate_prompts,
)
from pyengine.server.structured import name_constraint_error, structured_outputs_params
from pyengine.text.token_pieces import TokenPieces

router = APIRouter()


def completion_logprobs(tt: TokenPieces, logprobs: Optional[LogprobArrays], text_offset: int) -> CompletionLogprobs:
    """The legacy completions logprobs object for some generated tokens, from the engine's
    arrays (``text_offset``: where the first token's text starts)."""
    out = CompletionLogprobs()
    offset = text_offset
    for row in logprobs.rows() if logprobs is not None else ():
        token, value, _ = row[0]  # the generated token itself
        out.tokens.append(tt.text(token))
        out.token_logprobs.append(value)
        out.top_logprobs.append({tt.text(t): v for t, v, _ in sorted(row, key=lambda entry: -entry[1])})
        out.text_offset.append(offset)
        offset += tt.text_length(token)
    return out


def echoed_logprobs(tt: TokenPieces, prompt_ids: list[int], prompt_logprobs: LogprobArrays, top: int,
                    generated: CompletionLogprobs) -> CompletionLogprobs:
    """``echo`` with ``logprobs``: the prompt's tokens first (the first has no logprob, as
    OpenAI's), each with its top ``top``, then the generated tokens' (whose text offsets
    already count the echoed prompt)."""
    out = CompletionLogprobs()
    offset = 0
    for token, row in zip(prompt_ids, [None, *prompt_logprobs.rows()]):
        out.tokens.append(tt.text(token))
        out.text_offset.append(offset)
        offset += tt.text_length(token)
        if row is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(row[0][1])  # the prompt token itself
        best = sorted(((t, v) for t, v, rank in row if rank <= top), key=lambda entry: -entry[1])
        out.top_logprobs.append({tt.text(t): v for t, v in best})
    out.tokens += generated.tokens
    out.token_logprobs += generated.token_logprobs
    out.top_logprobs += generated.top_logprobs
    out.text_offset += generated.text_offset
    return out


def check_streamable(body: CompletionRequest) -> None:
    """What a stream cannot carry, refused as vLLM and OpenAI refuse it."""
    if not body.stream:
        return
    if body.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
    if body.echo and body.logprobs is not None:
        raise bad_request("echo with logprobs is not available when stream is true", "echo")
    if body.best_of is not None and body.best_of > body.n:
        raise bad_request("best_of > n cannot be streamed (the best are known only at the end)", "best_of")


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request,
                            ctx: Context) -> Union[Response, JSONResponse]:
    ctx.check_model(body.model)
    ctx.check_alive()
    if body.use_beam_search:
        return await beam_search_completion(ctx, body, request)
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    check_streamable(body)
    best_of = body.best_of if body.best_of is not None and body.best_of != body.n else None
    echo_logprobs = body.echo and body.logprobs is not None  # the prompt's tokens get logprobs too
    prompt_logprobs = body.prompt_logprobs
    if echo_logprobs and prompt_logprobs != -1:
        prompt_logprobs = max(prompt_logprobs or 0, body.logprobs or 0)
    constraint, constraint_param = structured_outputs_params(body)
    params = sampling_params(ctx, body, max_tokens=body.max_tokens, logprobs=body.logprobs,  # field checks first
                             structured_outputs=constraint, prompt_logprobs=prompt_logprobs, best_of=best_of)
    prompts = await off_the_loop_if_long(text_size(body.prompt), tokenize_prompts, ctx, body.prompt, "prompt")
    prompts = truncate_prompts(ctx, prompts, params)
    for _, ids in prompts:
        check_length(ctx, len(ids), body.max_tokens, "prompt")
    if params.max_tokens is None:  # null: what the longest prompt leaves (not the engine's guess)
        params.max_tokens = default_max_tokens(ctx, [len(ids) for _, ids in prompts])
    prompt_ids = [ids for _, ids in prompts]
    try:
        run = await ResponseRun.start(ctx, request, prompt_ids, params, ctx.new_id("cmpl"))
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
        prompt_lps = run.tracker.prompt_logprobs[p]
        lps = None
        if body.logprobs is not None:
            lps = completion_logprobs(ctx.token_text, choice.logprob_arrays(), len(echoes[p]))
            if echo_logprobs and prompt_lps is not None:
                lps = echoed_logprobs(ctx.token_text, prompts[p][1], prompt_lps, body.logprobs or 0, lps)
        choices.append(CompletionChoice(
            index=choice.index, text=echoes[p] + choice.text, logprobs=lps, finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
            prompt_token_ids=prompts[p][1] if body.return_token_ids else None,
            token_ids=choice.token_ids if body.return_token_ids else None,
            prompt_logprobs=prompt_logprobs_json(prompt_lps) if body.prompt_logprobs is not None else None,
        ))
    response = CompletionResponse(id=run.requests.request_id, model=ctx.args.model_name, choices=choices,
                                  usage=run.tracker.usage())
    return JSONResponse(response.model_dump())


def _stream(ctx: ServerContext, body: CompletionRequest, run: ResponseRun, echoes: list[str],
            prompt_ids: list[list[int]]) -> StreamingResponse:
    """With ``echo`` or ``return_token_ids``, a first chunk per choice carries the prompt;
    then text deltas."""
    n = run.tracker.n

    def choice(index: int, text: str, delta: Optional[ChoiceDelta] = None, first: bool = False) -> CompletionChoice:
        lps = None
        if delta is not None and body.logprobs is not None:
            lps = completion_logprobs(ctx.token_text, delta.logprobs, len(echoes[index // n]) + delta.text_offset)
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
