"""``POST /v1/chat/completions``: messages rendered with the checkpoint's chat template,
then generated like a completion; streamed as role / content deltas or returned whole.

Roles are OpenAI's; special tokens a client types stay text (``chat_text.py``); without
``max_tokens`` a chat may generate up to what one request can hold, not a 400."""

from __future__ import annotations

from typing import Any, Optional, Union

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from pyengine.outputs import LOGPROB_FLOOR
from pyengine.server.choices import ChoiceDelta
from pyengine.server.context import Context, ServerContext
from pyengine.server.errors import bad_request
from pyengine.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatLogprobToken,
    ChatLogprobTop,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
)
from pyengine.server.respond import Generation, wants_usage
from pyengine.server.sampling import check_length, default_max_tokens, sampling_params
from pyengine.server.structured import refuse_constraints
from pyengine.server.tokens import TokenText
from pyengine.server.tools import refuse_tools

router = APIRouter()

ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's chat roles


def chat_logprobs(tt: TokenText, token_ids: list[int], logprobs: list[dict[int, float]], top: int) -> ChatLogprobs:
    """The chat logprobs object: per token its text, logprob, bytes and the ``top`` best."""
    content = []
    for token, lps in zip(token_ids, logprobs):
        best = sorted(lps.items(), key=lambda kv: -kv[1])[:top]
        content.append(ChatLogprobToken(
            token=tt.text(token), logprob=lps.get(token, LOGPROB_FLOOR), bytes=tt.bytes(token),
            top_logprobs=[ChatLogprobTop(token=tt.text(t), logprob=v, bytes=tt.bytes(t)) for t, v in best],
        ))
    return ChatLogprobs(content=content)


def check_messages(messages: list[ChatMessage]) -> None:
    """A 400 naming the field: ``messages[i].role`` for a role OpenAI does not have (a
    template would render it as a turn of its own, or fail somewhere less clear), and
    ``messages[i].content[j].type`` for a part that is not text (an image or audio part:
    the model takes text only)."""
    for i, message in enumerate(messages):
        if message.role not in ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {message.role!r}",
                              f"messages[{i}].role", "invalid_value")
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            where = f"messages[{i}].content[{j}]"
            if part.type != "text":
                kind = "an image" if "image" in part.type else "audio" if "audio" in part.type else "a non-text"
                raise bad_request(f"{where}.type is {part.type!r}: this model takes text only, so {kind} content "
                                  "part cannot be given; send content parts of type 'text'", f"{where}.type",
                                  "unsupported_content_type")
            if part.text is None:
                raise bad_request(f"{where}.text is required for a part of type 'text'", f"{where}.text")


def render_prompt(ctx: ServerContext, messages: list[ChatMessage], add_generation_prompt: bool,
                  template_kwargs: Optional[dict[str, Any]] = None, add_special_tokens: bool = False) -> list[int]:
    """The chat's prompt token ids (a 400 when there is no chat template). Only the
    template's own special tokens become control tokens (``chat_text.py``)."""
    if ctx.chat_template is None:
        raise bad_request("this model has no chat template (no chat_template.jinja or chat_template in "
                          "tokenizer_config.json); start the server with --chat-template, or use "
                          "/v1/completions", "messages", "chat_template_missing")
    if ctx.chat_tokenizer is None:
        raise bad_request("this model has no tokenizer; use /v1/completions with token ids", "messages")
    escapes = ctx.chat_tokenizer.session()
    rendered = [{"role": m.role, "content": escapes.escape(m.text()),
                 **({"name": escapes.escape(m.name)} if m.name else {})}
                for m in messages]
    text = ctx.chat_template.render(rendered, add_generation_prompt, escapes.escape(template_kwargs))
    return escapes.encode(text, add_special_tokens)


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 ctx: Context) -> Union[Response, JSONResponse]:
    ctx.check_model(body.model)
    ctx.check_alive()
    check_messages(body.messages)
    refuse_tools(body)
    refuse_constraints(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs = true", "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    top = body.top_logprobs or 0
    renames = {"logprobs": "top_logprobs", "max_tokens": tokens_param}
    # Field checks first (cheap, and a bad field is the clearer error); the real
    # max_tokens default needs the prompt's length.
    params = sampling_params(ctx, body, max_tokens=max_tokens, logprobs=top if body.logprobs else None,
                             renames=renames)
    prompt_ids = render_prompt(ctx, body.messages, body.add_generation_prompt, body.chat_template_kwargs,
                               body.add_special_tokens)
    check_length(ctx, len(prompt_ids), max_tokens, "messages", tokens_param)
    if params.max_tokens is None:
        params.max_tokens = default_max_tokens(ctx, [len(prompt_ids)])
    run = await Generation.start(ctx, request, [prompt_ids], params, ctx.new_id("chatcmpl"))
    if body.stream:
        return _stream(ctx, body, run, top)
    gone = await run.collect()
    if gone is not None:
        return gone
    choices = [
        ChatChoice(
            index=c.index, message=ChatResponseMessage(content=c.text),
            logprobs=chat_logprobs(ctx.token_text, c.token_ids, c.logprobs, top) if body.logprobs else None,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            token_ids=c.token_ids if body.return_token_ids else None,
        )
        for c in run.tracker.choices
    ]
    response = ChatCompletionResponse(id=run.gen.request_id, model=ctx.args.model_name, choices=choices,
                                      usage=run.tracker.usage(),
                                      prompt_token_ids=prompt_ids if body.return_token_ids else None)
    return JSONResponse(response.model_dump())


def _stream(ctx: ServerContext, body: ChatCompletionRequest, run: Generation, top: int) -> StreamingResponse:
    """Role chunks first (one per choice), then content deltas."""

    def choice(index: int, delta: ChatDelta, d: Optional[ChoiceDelta] = None) -> ChatStreamChoice:
        return ChatStreamChoice(
            index=index, delta=delta,
            logprobs=chat_logprobs(ctx.token_text, d.token_ids, d.logprobs, top) if d and body.logprobs else None,
            finish_reason=d.finish_reason if d else None,
            stop_reason=d.choice.stop_reason if d and d.finish_reason else None,
            token_ids=d.token_ids if d and body.return_token_ids else None,
        )

    head = (choice(c.index, ChatDelta(role="assistant", content="")) for c in run.tracker.choices)
    return run.stream(ChatCompletionChunk, head, lambda d: choice(d.choice.index, ChatDelta(content=d.text), d),
                      usage=wants_usage(body))
