"""Tool calling in chat: what a request says about tools, and tool calls in its answer.

- ``tools`` reach the chat template (``tools=``), as in transformers and vLLM; the
  history may hold assistant turns with ``tool_calls`` and ``tool`` turns answering them.
- ``tool_choice="auto"`` (the default when tools are given) parses tool calls out of the
  generated text with the server's ``--tool-call-parser``; vLLM asks for
  ``--enable-auto-tool-choice`` too, and so do we: without it such a request is a 400
  rather than tools the model sees but calls nobody reads.
- ``tool_choice="none"``: the tools are rendered, the text is not parsed (vLLM's way).
- ``tool_choice="required"`` or a named function constrains generation with a grammar:
  with ``--tool-call-parser``, over the model's own tool-call format (the parser's
  ``forced_grammar``; why: ``tool_parsers/forced.py``), the answer then parsed like any
  other; without one, over vLLM's format (a JSON array of ``{"name", "parameters"}``
  calls, or a named function's arguments alone: ``forced_tools.py``). Neither needs
  ``--enable-auto-tool-choice``.
- OpenAI's deprecated ``functions`` / ``function_call`` are 400s naming them.

A response with tool calls says ``finish_reason="tool_calls"`` (when the model stopped on
its own; a call cut by ``max_tokens`` stays ``length``), except for a named function:
``stop``, as OpenAI and vLLM answer it. Call ids are ``call_`` and 24 hex
digits, fresh per call.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from pyengine.errors import InvalidRequestError
from pyengine.inputs.chat_template import template_tool_calls
from pyengine.server.errors import bad_request
from pyengine.server.forced_tools import ForcedToolCalls, forced_tool_calls
from pyengine.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatResponseMessage,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
)
from pyengine.server.tool_parsers import (
    TOOL_PARSERS,
    ParseStep,
    ToolCallStream,
    parse_whole,
    tool_call_stream,
)
from pyengine.structured_outputs import StructuredOutputsParams


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses tools: what the template gets, and which parser (if
    any) reads the answer."""

    tools: Optional[list[dict[str, Any]]] = None
    parser: Optional[str] = None
    max_calls: Optional[int] = None  # 1 with parallel_tool_calls=false
    grammar: Optional[str] = None  # tool_choice "required" / named: generation constrained to calls
    named: bool = False  # tool_choice names the function
    forced: Optional[ForcedToolCalls] = None  # forced without a parser: vLLM's format, read by its own parser

    def finish_reason(self, has_calls: bool, reason: Optional[str]) -> Optional[str]:
        """``tool_calls`` when the model called and stopped on its own; ``stop`` when the
        client named the function, as OpenAI (and vLLM) answer a forced call."""
        return "tool_calls" if has_calls and reason == "stop" and not self.named else reason

    def structured_outputs(self) -> Optional[StructuredOutputsParams]:
        """The constraint that forces the calls, if the request forces them."""
        return StructuredOutputsParams(grammar=self.grammar) if self.grammar is not None else None

    def stream(self) -> Optional[ToolCallStream]:
        """A parser for one choice, or None when answers are not parsed."""
        if self.forced is not None:
            return self.forced.stream()
        return tool_call_stream(self.parser, self.max_calls) if self.parser is not None else None

    @property
    def keeps_special_tokens(self) -> bool:
        """The parser's format may be written in special tokens, which the text must keep."""
        return self.parser is not None and TOOL_PARSERS[self.parser].keeps_special_tokens


def tool_plan(body: ChatCompletionRequest, parser: Optional[str], auto_enabled: bool) -> ToolPlan:
    """The request's tool plan; 400s name the field (in the order a client would fix them)."""
    if body.functions is not None:
        raise bad_request("functions is OpenAI's deprecated spelling of tools and is not supported; use tools",
                          "functions", "unsupported_parameter")
    if body.function_call is not None:
        raise bad_request("function_call is OpenAI's deprecated spelling of tool_choice and is not supported; "
                          "use tool_choice", "function_call", "unsupported_parameter")
    if not body.tools:
        if body.tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools: with no tools there is nothing to call", "tool_choice")
        return ToolPlan()
    for i, tool in enumerate(body.tools):
        if tool.type != "function":
            raise bad_request(f"tools[{i}].type must be 'function'; got {tool.type!r}", f"tools[{i}].type",
                              "invalid_value")
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    if choice == "none":
        return ToolPlan(tools)
    if choice == "auto":
        if not auto_enabled or parser is None:
            raise bad_request('tool_choice "auto" (the default when tools are given) needs the server started '
                              "with --enable-auto-tool-choice and --tool-call-parser; send tool_choice \"none\" "
                              "to have the tools shown to the model without parsing its answer", "tool_choice",
                              "unsupported_parameter")
        return ToolPlan(tools, parser, 1 if body.parallel_tool_calls is False else None)
    if not isinstance(choice, str):
        if choice.type != "function":
            raise bad_request(f"tool_choice.type must be 'function'; got {choice.type!r}", "tool_choice.type",
                              "invalid_value")
        names = [tool.function.name for tool in body.tools]
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not among the "
                              f"tools ({', '.join(names)})", "tool_choice.function.name", "invalid_value")
    functions = [tool["function"] for tool in tools]
    if parser is None:  # vLLM's format: a JSON array of calls, or the named function's arguments
        forced = forced_tool_calls(functions, None if isinstance(choice, str) else choice.function.name,
                                   parallel=body.parallel_tool_calls is not False)
        return ToolPlan(tools, None, None if forced.many else 1, forced.grammar, forced.named, forced)
    if isinstance(choice, str):  # "required": one call or more (one with parallel_tool_calls=false)
        many = body.parallel_tool_calls is not False
    else:
        functions = [f for f in functions if f["name"] == choice.function.name][:1]
        many = False
    grammar = TOOL_PARSERS[parser].forced_grammar(functions, many)
    return ToolPlan(tools, parser, None if many else 1, grammar, named=not isinstance(choice, str))


def check_history(messages: list[ChatMessage]) -> None:
    """``tool_calls`` belong to assistant turns, with JSON arguments."""
    for i, message in enumerate(messages):
        if message.tool_calls is not None and message.role != "assistant":
            raise bad_request(f"messages[{i}].tool_calls is only allowed on an assistant message (role is "
                              f"{message.role!r})", f"messages[{i}].tool_calls")
        if message.tool_calls:
            template_calls(message, i)


def template_calls(message: ChatMessage, i: int) -> list[dict[str, Any]]:
    """``message``'s tool calls as the template gets them (arguments parsed)."""
    where = f"messages[{i}].tool_calls"
    try:
        return template_tool_calls([c.model_dump(exclude_none=True) for c in message.tool_calls or ()], where)
    except InvalidRequestError as error:
        param = str(error).split(" ", 1)[0]
        raise bad_request(str(error), param if param.startswith(where) else where) from None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def whole_message(plan: ToolPlan, text: str, reason: Optional[str]) -> tuple[ChatResponseMessage, Optional[str]]:
    """The assistant message of a whole response, and its finish reason."""
    stream = plan.stream()
    if stream is None:
        return ChatResponseMessage(content=text), reason
    parsed = parse_whole(stream, text)
    calls = [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
             for c in parsed.calls]
    return ChatResponseMessage(content=parsed.content, tool_calls=calls or None), plan.finish_reason(bool(calls), reason)


@dataclass
class StreamedToolCalls:
    """One choice's stream: text deltas in, content and tool-call deltas out."""

    stream: ToolCallStream
    ids: dict[int, str] = field(default_factory=dict)

    def delta(self, text: str, finished: bool) -> tuple[Optional[str], Optional[list[ToolCallDelta]]]:
        step = self.stream.feed(text)
        if finished:
            step += self.stream.finish()
        return (step.content or None), self._tool_deltas(step)

    @property
    def called(self) -> bool:
        """Whether the choice is tool calls, by the whole response's rule (valid calls only):
        at the finish, a call that turned out malformed (its deltas already sent) makes
        ``finish_reason`` "stop", as the whole response says."""
        return self.stream.has_valid_calls

    def _tool_deltas(self, step: ParseStep) -> Optional[list[ToolCallDelta]]:
        out = []
        for chunk in step.calls:
            if chunk.name is not None:
                self.ids[chunk.index] = new_call_id()
                out.append(ToolCallDelta(index=chunk.index, id=self.ids[chunk.index], type="function",
                                         function=FunctionCallDelta(name=chunk.name, arguments=chunk.arguments)))
            elif out and out[-1].index == chunk.index and out[-1].function is not None:
                function = out[-1].function
                function.arguments = (function.arguments or "") + chunk.arguments
            else:
                out.append(ToolCallDelta(index=chunk.index, function=FunctionCallDelta(arguments=chunk.arguments)))
        return out or None
