"""A Responses request made into what the engine runs, by the chat endpoint's own steps.

The request becomes a ``ChatCompletionRequest`` (its conversation, tools, ``tool_choice``,
``text.format`` as ``response_format``, ``max_output_tokens`` as ``max_tokens``), and
then goes the way a chat does: the same message and history checks, the same tool plan
(``tools.py``: ``auto`` through ``--tool-call-parser``; ``required`` / a named function
as chat serves them), the same constraint, sampling parameters, chat template and length
checks. So the two endpoints cannot drift apart in what they render or refuse; only the
field names in the errors are the Responses API's (``text.format``, ``max_output_tokens``,
``input[i]``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pyengine.sampling_params import SamplingParams
from pyengine.server.chat import check_messages, render_prompt
from pyengine.server.context import ServerContext
from pyengine.server.errors import APIError, bad_request
from pyengine.server.offload import off_the_loop_if_long, text_size
from pyengine.server.protocol import ChatCompletionRequest
from pyengine.server.responses.conversation import Conversation
from pyengine.server.responses.protocol import ResponsesRequest
from pyengine.server.sampling import check_length, default_max_tokens, sampling_params, truncate_prompts
from pyengine.server.structured import structured_outputs_params
from pyengine.server.tools import ToolPlan, check_history, tool_plan
from pyengine.structured_outputs import StructuredOutputsParams

TEXT_FORMATS = ("text", "json_object", "json_schema")
# Chat's field names in errors, as a Responses client spells them.
_FIELD_NAMES = {"response_format": "text.format", "max_tokens": "max_output_tokens",
                "tool_choice.function.name": "tool_choice.name"}


@dataclass
class Prepared:
    prompt_ids: list[int]
    params: SamplingParams
    plan: ToolPlan
    constraint_param: Optional[str]  # the field a constraint error names


async def prepare(ctx: ServerContext, body: ResponsesRequest, conv: Conversation) -> Prepared:
    """The prompt, parameters and tool plan of ``body``; every refusal is a 400 naming
    the Responses field at fault."""
    try:
        chat = chat_request(body, conv)
        check_messages(chat.messages)
        check_history(chat.messages)
        plan = tool_plan(chat, ctx.args.tool_call_parser, ctx.args.enable_auto_tool_choice)
        constraint, constraint_param = _constraint(chat, plan)
        params = sampling_params(ctx, chat, max_tokens=body.max_output_tokens, logprobs=None,
                                 renames={"max_tokens": "max_output_tokens"}, structured_outputs=constraint)
        if plan.keeps_special_tokens:
            params.skip_special_tokens = False  # the tool-call tags may be special tokens
        prompt_ids = await off_the_loop_if_long(text_size(chat.messages), render_prompt, ctx, chat.messages, True,
                                                None, False, plan.tools)
        prompt_ids = truncate_prompts(ctx, [(None, prompt_ids)], params)[0][1]
        check_length(ctx, len(prompt_ids), body.max_output_tokens, "input", "max_output_tokens")
    except APIError as error:
        raise responses_error(error, conv) from None
    if params.max_tokens is None:
        params.max_tokens = default_max_tokens(ctx, [len(prompt_ids)])
    return Prepared(prompt_ids, params, plan, constraint_param)


def responses_error(error: APIError, conv: Conversation) -> APIError:
    """A chat-shaped refusal as the Responses API names its fields."""
    error = conv.rename(error)
    for chat_name, name in _FIELD_NAMES.items():
        if error.param is not None and (error.param == chat_name or error.param.startswith(chat_name + ".")):
            message = error.message.replace(chat_name, name, 1)
            return APIError(error.status, message, name + error.param[len(chat_name):], error.code, error.type)
    return error


def chat_request(body: ResponsesRequest, conv: Conversation) -> ChatCompletionRequest:
    """``body`` as the chat request it amounts to."""
    fields: dict[str, Any] = {"messages": conv.messages, "max_tokens": body.max_output_tokens,
                              "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream,
                              "parallel_tool_calls": body.parallel_tool_calls}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude_none=True, exclude={"type"})}
                           for tool in body.tools]
        for i, tool in enumerate(body.tools):
            if tool.name is None:
                raise bad_request(f"tools[{i}].name is required for a tool of type 'function'", f"tools[{i}].name")
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = choice if isinstance(choice, str) else \
            {"type": "function", "function": {"name": _named(choice.name)}}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None:
        fields["response_format"] = _response_format(fmt)
    return ChatCompletionRequest.model_validate(fields)


def _named(name: Optional[str]) -> str:
    if name is None:
        raise bad_request("tool_choice.name is required when tool_choice.type is 'function'", "tool_choice.name")
    return name


def _response_format(fmt: Any) -> dict[str, Any]:
    if fmt.type not in TEXT_FORMATS:
        raise bad_request(f"text.format.type must be one of {', '.join(TEXT_FORMATS)}; got {fmt.type!r}",
                          "text.format.type", "invalid_value")
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    if fmt.json_schema is None:
        raise bad_request("text.format of type 'json_schema' needs schema (the JSON schema)", "text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.json_schema,
                                                   "strict": fmt.strict}}


def _constraint(chat: ChatCompletionRequest, plan: ToolPlan) -> tuple[Optional[StructuredOutputsParams],
                                                                     Optional[str]]:
    """``text.format``'s constraint, or the grammar a forced ``tool_choice`` brings (both
    at once is a 400, as on chat)."""
    constraint, param = structured_outputs_params(chat)
    if plan.grammar is None:
        return constraint, "text.format" if param is not None else None
    if param is not None:
        raise bad_request("a forced tool_choice constrains the answer to tool calls, so text.format cannot "
                          "constrain it too", "text.format", "conflicting_constraints")
    return plan.structured_outputs(), "tools"
