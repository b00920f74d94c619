"""What a chat request says about tools: ``tools``, ``tool_choice`` and OpenAI's
deprecated ``functions`` / ``function_call``.

Until tool calling is served, any request that offers tools is a 400 naming the field:
answering it with free text and no ``tool_calls`` would look like a model that chose not
to call, which a client cannot tell from a dropped feature. ``tool_choice="none"`` (or no
``tool_choice``) without tools asks for nothing and passes.
"""

from __future__ import annotations

from pyengine.server.errors import bad_request
from pyengine.server.protocol import ChatCompletionRequest


def check_tool_fields(body: ChatCompletionRequest) -> None:
    """400s naming the field, in the order a client would fix them."""
    if body.functions is not None:
        raise bad_request("functions is OpenAI's deprecated spelling of tools and is not supported; use tools",
                          "functions", "unsupported_parameter")
    if body.function_call is not None:
        raise bad_request("function_call is OpenAI's deprecated spelling of tool_choice and is not supported; "
                          "use tool_choice", "function_call", "unsupported_parameter")
    if not body.tools and body.tool_choice not in (None, "none"):
        raise bad_request("tool_choice needs tools: with no tools there is nothing to call", "tool_choice")


def refuse_tools(body: ChatCompletionRequest) -> None:
    """A 400 naming ``tools`` / ``tool_choice`` while this server cannot honour them."""
    check_tool_fields(body)
    if body.tools:
        raise bad_request("tools is not supported by this server yet: the tools would not reach the model and "
                          "no tool call would be returned", "tools", "unsupported_parameter")
