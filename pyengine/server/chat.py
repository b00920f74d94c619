"""``POST /v1/chat/completions``: messages rendered with the checkpoint's chat template,
then generated like a completion; streamed as role / content / tool-call deltas or
returned whole. Tools: ``tools.py``.

Roles are OpenAI's; the prompt is rendered as ``LLM.chat`` renders it (special tokens a
client types stay text: ``pyengine/inputs/chat_template.py``); without
``max_tokens`` a chat may generate up to what one request can hold, not a 400."""

from __future__ import annotations

from typing import Any, Optional, Union

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from pyengine.errors import InvalidRequestError
from pyengine.inputs.chat_template import render_chat
from pyengine.logprob_arrays import LogprobArrays
from pyengine.server.beam_search import beam_search_chat, check_chat
from pyengine.server.choices import ChoiceDelta
from pyengine.server.context import Context, ServerContext
from pyengine.server.errors import APIError, bad_request
from pyengine.server.offload import off_the_loop_if_long, text_size
from pyengine.server.prompt_logprobs import prompt_logprobs_json
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
    ChatStreamChoice,
)
from pyengine.server.respond import ResponseRun, wants_usage
from pyengine.server.sampling import check_length, default_max_tokens, sampling_params, truncate_prompts
from pyengine.server.structured import name_constraint_error, structured_outputs_params
from pyengine.server.tools import (
    StreamedToolCalls,
    ToolPlan,
    check_history,
    tool_plan,
    whole_message,
)
from pyengine.structured_outputs import StructuredOutputsParams
from pyengine.text.token_pieces import TokenPieces

router = APIRouter()

ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's chat roles


def chat_logprobs(tt: TokenPieces, logprobs: Optional[LogprobArrays], top: int) -> ChatLogprobs:
    """The chat logprobs object, from the engine's arrays: per token its text, logprob,
    bytes and the ``top`` best of its entries."""
    content = []
    for row in logprobs.rows() if logprobs is not None else ():
        token, value, _ = row[0]  # the generated token itself
        best = sorted(row, key=lambda entry: -entry[1])[:top]
        content.append(ChatLogprobToken(
            token=tt.text(token), logprob=value, bytes=tt.bytes(token),
            top_logprobs=[ChatLogprobTop(token=tt.text(t), logprob=v, bytes=tt.bytes(t)) for t, v, _ in best],
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
                  template_kwargs: Optional[dict[str, Any]] = None, add_special_tokens: bool = False,
                  tools: Optional[list[dict[str, Any]]] = None) -> list[int]:
    """The chat's prompt token ids, rendered as ``LLM.chat`` renders them
    (``pyengine.inputs.chat_template.render_chat``: only the template's own special tokens
    become control tokens); a 400 when there is no chat template or the template fails,
    naming the message at fault where the error does. ``tools`` reach the template as
    ``tools`` (None: no tools, as transformers passes it)."""
    if ctx.chat_template is None:
        raise bad_request("this model has no chat template (no chat_template.jinja or chat_template in "
                          "tokenizer_config.json); start the server with --chat-template, or use "
                          "/v1/completions", "messages", "chat_template_missing")
    if ctx.chat_tokenizer is None:
        raise bad_request("this model has no tokenizer; use /v1/completions with token ids", "messages")
    try:
        return render_chat(ctx.chat_template, ctx.chat_tokenizer, [_template_message(m) for m in messages],
                           add_generation_prompt=add_generation_prompt, tools=tools,
                           template_kwargs=template_kwargs, add_special_tokens=add_special_tokens).token_ids
    except InvalidRequestError as error:
        raise chat_request_error(error) from None


def chat_request_error(error: InvalidRequestError) -> APIError:
    """A 400 for a chat that did not render: ``param`` is the ``messages[i]...`` path the
    message starts with, else ``messages``."""
    first = str(error).split(" ", 1)[0]
    return bad_request(str(error), first if first.startswith("messages") else "messages")


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as ``render_chat`` takes it (OpenAI's keys, as ``LLM.chat`` gets them):
    role, content (text or text parts), and ``name``, ``tool_calls``, ``tool_call_id``
    when given."""
    content: Any = message.content
    if isinstance(content, list):
        content = [{"type": part.type, "text": part.text} for part in content]
    out: dict[str, Any] = {"role": message.role, "content": content}
    if message.name:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [call.model_dump(exclude_none=True) for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _constraint(body: ChatCompletionRequest, plan: ToolPlan) -> tuple[Optional[StructuredOutputsParams],
                                                                     Optional[str]]:
    """The request's output constraint and the field errors about it name: its
    ``response_format`` / ``structured_outputs`` / ``guided_*``, or the grammar of a
    forced ``tool_choice`` (a 400 when both are given)."""
    constraint, param = structured_outputs_params(body)
    if plan.grammar is None:
        return constraint, param
    if param is not None:
        raise bad_request(f"a forced tool_choice constrains the answer to tool calls, so {param} cannot "
                          "constrain it too", param, "conflicting_constraints")
    # The grammar is ours; only the tools' parameter schemas can make it fail to compile.
    return plan.structured_outputs(), "tools"


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 ctx: Context) -> Union[Response, JSONResponse]:
    ctx.check_model(body.model)
    ctx.check_alive()
    check_messages(body.messages)
    check_history(body.messages)
    plan = tool_plan(body, ctx.args.tool_call_parser, ctx.args.enable_auto_tool_choice)
    constraint, constraint_param = _constraint(body, plan)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs = true", "top_logprobs")
    if body.stream and body.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    if body.use_beam_search:
        return await _beam_search(ctx, body, request, plan, max_tokens, tokens_param)
    top = body.top_logprobs or 0
    renames = {"logprobs": "top_logprobs", "max_tokens": tokens_param}
    # Field checks first (cheap, and a bad field is the clearer error); the real
    # max_tokens default needs the prompt's length.
    params = sampling_params(ctx, body, max_tokens=max_tokens, logprobs=top if body.logprobs else None,
                             renames=renames, structured_outputs=constraint, prompt_logprobs=body.prompt_logprobs)
    if plan.keeps_special_tokens:
        params.skip_special_tokens = False  # the tool-call tags may be special tokens (as vLLM does)
    prompt_ids = await off_the_loop_if_long(text_size(body.messages), render_prompt, ctx, body.messages,
                                            body.add_generation_prompt, body.chat_template_kwargs,
                                            body.add_special_tokens, plan.tools)
    prompt_ids = truncate_prompts(ctx, [(None, prompt_ids)], params)[0][1]
    check_length(ctx, len(prompt_ids), max_tokens, "messages", tokens_param)
    if params.max_tokens is None:
        params.max_tokens = default_max_tokens(ctx, [len(prompt_ids)])
    try:
        run = await ResponseRun.start(ctx, request, [prompt_ids], params, ctx.new_id("chatcmpl"))
    except APIError as error:  # a schema, regex or grammar the engine cannot compile: named as sent
        raise name_constraint_error(error, constraint_param) from None
    if body.stream:
        return _stream(ctx, body, run, top, plan)
    gone = await run.collect()
    if gone is not None:
        return gone
    choices = []
    for c in run.tracker.choices:
        message, finish_reason = whole_message(plan, c.text, c.finish_reason)
        choices.append(ChatChoice(
            index=c.index, message=message,
            logprobs=chat_logprobs(ctx.token_text, c.logprob_arrays(), top) if body.logprobs else None,
            finish_reason=finish_reason, stop_reason=c.stop_reason,
            token_ids=c.token_ids if body.return_token_ids else None,
        ))
    response = ChatCompletionResponse(id=run.requests.request_id, model=ctx.args.model_name, choices=choices,
                                      usage=run.tracker.usage(),
                                      prompt_token_ids=prompt_ids if body.return_token_ids else None,
                                      prompt_logprobs=prompt_logprobs_json(run.tracker.prompt_logprobs[0])
                                      if body.prompt_logprobs is not None else None)
    return JSONResponse(response.model_dump())


async def _beam_search(ctx: ServerContext, body: ChatCompletionRequest, request: Request, plan: ToolPlan,
                       max_tokens: Optional[int], tokens_param: str) -> Response:
    """``use_beam_search``: the fields checked, the prompt rendered, the search run
    (``beam_search.py``)."""
    check_chat(ctx, body, plan, max_tokens, tokens_param)
    prompt_ids = await off_the_loop_if_long(text_size(body.messages), render_prompt, ctx, body.messages,
                                            body.add_generation_prompt, body.chat_template_kwargs,
                                            body.add_special_tokens, plan.tools)
    check_length(ctx, len(prompt_ids), max_tokens, "messages", tokens_param)
    return await beam_search_chat(ctx, body, request, plan, prompt_ids, max_tokens, tokens_param)


def _stream(ctx: ServerContext, body: ChatCompletionRequest, run: ResponseRun, top: int,
            plan: ToolPlan) -> StreamingResponse:
    """Role chunks first (one per choice), then content deltas; with a tool-call parser,
    content and tool-call deltas as the parser finds them (a delta that brings neither,
    no finish, no logprobs and no token ids is not sent)."""
    parsers = {c.index: StreamedToolCalls(stream) for c in run.tracker.choices
               if (stream := plan.stream()) is not None}

    def choice(index: int, delta: ChatDelta, d: Optional[ChoiceDelta] = None,
               finish_reason: Optional[str] = None) -> ChatStreamChoice:
        return ChatStreamChoice(
            index=index, delta=delta,
            logprobs=chat_logprobs(ctx.token_text, d.logprobs, top) if d and body.logprobs else None,
            finish_reason=finish_reason,
            stop_reason=d.choice.stop_reason if d and d.finish_reason else None,
            token_ids=d.token_ids if d and body.return_token_ids else None,
        )

    def delta(d: ChoiceDelta) -> Optional[ChatStreamChoice]:
        parser = parsers.get(d.choice.index)
        if parser is None:
            return choice(d.choice.index, ChatDelta(content=d.text), d, d.finish_reason)
        content, calls = parser.delta(d.text, d.finish_reason is not None)
        if content is None and calls is None and d.finish_reason is None \
                and not (body.logprobs or body.return_token_ids):
            return None
        return choice(d.choice.index, ChatDelta(content=content, tool_calls=calls), d,
                      plan.finish_reason(parser.called, d.finish_reason))

    head = (choice(c.index, ChatDelta(role="assistant", content="")) for c in run.tracker.choices)
    return run.stream(ChatCompletionChunk, head, delta, usage=wants_usage(body))
