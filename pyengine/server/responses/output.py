"""A finished generation as the response object: its output items, status and usage.

The output is a ``message`` item with the text (when there is any), then one
``function_call`` item per tool call the parser found. ``status`` is ``completed``, or
``incomplete`` with ``incomplete_details.reason = "max_output_tokens"`` when the length
limit cut the answer (OpenAI's spelling; vLLM says ``completed`` there outside gpt-oss).
Item ids are ``msg_`` / ``fc_`` and call ids ``call_`` (``tools.new_call_id``), fresh."""

from __future__ import annotations

import uuid
from typing import Any, Optional

from pyengine.server.protocol import ToolCall
from pyengine.server.responses.protocol import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from pyengine.server.tools import ToolPlan, whole_message


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(plan: ToolPlan, text: str) -> list[OutputItem]:
    """The output of a whole answer ``text``: its content, then its tool calls."""
    message, _ = whole_message(plan, text, "stop")
    items: list[OutputItem] = []
    if message.content:
        items.append(OutputMessage(id=new_item_id("msg"), content=[OutputText(text=message.content)]))
    items.extend(function_call_item(call) for call in message.tool_calls or ())
    return items


def function_call_item(call: ToolCall) -> FunctionCallItem:
    return FunctionCallItem(id=new_item_id("fc"), call_id=call.id, name=call.function.name,
                            arguments=call.function.arguments)


def usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> ResponseUsage:
    return ResponseUsage(input_tokens=input_tokens, input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
                         output_tokens=output_tokens, total_tokens=input_tokens + output_tokens)


def status_of(finish_reason: Optional[str]) -> tuple[str, Optional[IncompleteDetails]]:
    if finish_reason == "length":
        return "incomplete", IncompleteDetails(reason="max_output_tokens")
    return "completed", None


def response_object(body: ResponsesRequest, response_id: str, model: str, created_at: float, status: str,
                    **fields: Any) -> ResponseObject:
    """The response object for ``body`` (its settings echoed, as OpenAI does), with the
    given ``status`` and any of output / usage / error / incomplete_details."""
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    return ResponseObject(
        id=response_id, created_at=created_at, status=status, model=model, instructions=body.instructions,
        max_output_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
        parallel_tool_calls=body.parallel_tool_calls is not False, previous_response_id=body.previous_response_id,
        store=body.store, text={"format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt else {"type": "text"}},
        tool_choice=_dumped(body.tool_choice) if body.tool_choice is not None else "auto",
        tools=[tool.model_dump(exclude_none=True) for tool in body.tools or ()], metadata=body.metadata,
        user=body.user, **fields)


def _dumped(value: Any) -> Any:
    return value if isinstance(value, str) else value.model_dump(exclude_none=True)
