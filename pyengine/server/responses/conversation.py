"""A Responses request's conversation as chat messages: what the chat template renders.

The messages are, in order: ``instructions`` as a system message, the conversation the
``previous_response_id`` chain holds (its inputs and outputs, as stored), then ``input``
(a string is one user message; items become messages):

- a message item (``type`` "message" or absent): its role (``user``, ``system``,
  ``developer``, ``assistant``) and its text (``input_text`` / ``output_text`` parts);
- a ``function_call`` item: an assistant turn's tool call (``call_id`` is the call's id),
  joined to the assistant message just before it, so that a text answer and the calls
  after it are one turn, as chat has them;
- a ``function_call_output`` item: a ``tool`` message answering ``call_id``.

Earlier instructions are not carried along a chain: each request's own apply (OpenAI's
rule; vLLM keeps the earlier ones in its stored messages). Every message remembers the
request field it came from, so a template's or a check's error about ``messages[i]``
names what the client sent (``input[2]``, ``instructions``, ``previous_response_id``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from pyengine.server.errors import APIError, bad_request
from pyengine.server.protocol import ChatMessage
from pyengine.server.responses.protocol import (
    InputItem,
    OutputItem,
    OutputMessage,
    ResponseContentPart,
    ResponsesRequest,
)

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
_MESSAGES_PATH = re.compile(r"^messages\[(\d+)\]")


@dataclass
class Conversation:
    """The chat messages of one request, each with the request field it came from;
    ``history`` is the part a stored response keeps (all but the instructions)."""

    messages: list[ChatMessage] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)
    history_start: int = 0

    def add(self, message: ChatMessage, origin: str) -> None:
        self.messages.append(message)
        self.origins.append(origin)

    def history(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages[self.history_start:]]

    def rename(self, error: APIError) -> APIError:
        """``error`` with ``messages[i]`` (in its ``param`` and its message) spelled as the
        field message ``i`` came from."""
        def spelled(text: Optional[str]) -> Optional[str]:
            match = _MESSAGES_PATH.match(text or "")
            if match is None or int(match.group(1)) >= len(self.origins):
                return text
            return self.origins[int(match.group(1))] + text[match.end():]

        if not (error.param or "").startswith("messages"):
            return error
        return APIError(error.status, spelled(error.message) or error.message, spelled(error.param), error.code,
                        error.type)


def conversation(body: ResponsesRequest, history: Optional[list[dict[str, Any]]]) -> Conversation:
    """The messages ``body`` asks the model to answer; ``history`` is the stored
    conversation of ``previous_response_id`` (None: none). A 400 names the item at fault."""
    conv = Conversation()
    if body.instructions:
        conv.add(ChatMessage(role="system", content=body.instructions), "instructions")
    conv.history_start = len(conv.messages)
    for message in history or ():
        conv.add(ChatMessage.model_validate(message), "previous_response_id")
    if isinstance(body.input, str):
        conv.add(ChatMessage(role="user", content=body.input), "input")
        return conv
    if not body.input:
        raise bad_request("input must not be empty: give a string or at least one item", "input")
    for i, item in enumerate(body.input):
        _add_item(conv, item, f"input[{i}]")
    return conv


def _add_item(conv: Conversation, item: InputItem, where: str) -> None:
    kind = item.type or "message"
    if kind == "message":
        if item.role not in MESSAGE_ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}; got {item.role!r}",
                              f"{where}.role", "invalid_value")
        conv.add(ChatMessage(role=item.role, content=_text(item.content, f"{where}.content")), where)
    elif kind == "function_call":
        for name in ("call_id", "name", "arguments"):
            if getattr(item, name) is None:
                raise bad_request(f"{where}.{name} is required for an item of type 'function_call'",
                                  f"{where}.{name}")
        _check_arguments(item.arguments, f"{where}.arguments")
        call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        last = conv.messages[-1] if len(conv.messages) > conv.history_start else None
        if last is not None and last.role == "assistant":  # the same turn: its text, then its calls
            last.tool_calls = [*(last.tool_calls or []), *ChatMessage(role="assistant", tool_calls=[call]).tool_calls]
        else:
            conv.add(ChatMessage(role="assistant", tool_calls=[call]), where)
    elif kind == "function_call_output":
        for name in ("call_id", "output"):
            if getattr(item, name) is None:
                raise bad_request(f"{where}.{name} is required for an item of type 'function_call_output'",
                                  f"{where}.{name}")
        conv.add(ChatMessage(role="tool", content=_text(item.output, f"{where}.output"), tool_call_id=item.call_id),
                 where)
    elif kind == "reasoning":
        raise bad_request(f"{where} is a reasoning item: this server runs no reasoning parser and takes no "
                          "reasoning back; leave reasoning items out of input", f"{where}.type",
                          "unsupported_item")
    else:
        raise bad_request(f"{where}.type {kind!r} is not served: input items may be messages, function_call and "
                          "function_call_output (no built-in tool calls, no item references)", f"{where}.type",
                          "unsupported_item")


def _check_arguments(arguments: str, where: str) -> None:
    """A call's arguments are JSON text (the template gets them parsed, as on chat);
    checked here so that the error names the item, not the merged assistant turn."""
    try:
        json.loads(arguments)
    except ValueError as error:
        raise bad_request(f"{where} is not valid JSON: {error}", where) from None


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or its text parts joined."""
    if content is None:
        raise bad_request(f"{where} is required", where)
    if isinstance(content, str):
        return content
    parts: list[ResponseContentPart] = content
    for j, part in enumerate(parts):
        if part.type not in _TEXT_PARTS:
            raise bad_request(f"{where}[{j}].type is {part.type!r}: this model takes text only; send parts of type "
                              "'input_text' (or 'output_text' for an assistant's)", f"{where}[{j}].type",
                              "unsupported_content_type")
        if part.text is None:
            raise bad_request(f"{where}[{j}].text is required for a part of type {part.type!r}", f"{where}[{j}].text")
    return "".join(part.text or "" for part in parts)


def output_messages(output: list[OutputItem]) -> list[dict[str, Any]]:
    """A response's output as the chat messages a later turn's history holds: one
    assistant turn with its text and its calls."""
    text = "".join(part.text for item in output if isinstance(item, OutputMessage) for part in item.content)
    calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
             for item in output if not isinstance(item, OutputMessage)]
    if not text and not calls:
        return [{"role": "assistant", "content": ""}]
    message = ChatMessage(role="assistant", content=text if text else None, tool_calls=calls or None)
    return [message.model_dump(exclude_none=True)]
