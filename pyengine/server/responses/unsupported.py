"""What a Responses request may ask for that this server does not serve, refused with a
400 that names it (never dropped: a client that asked for web search and got an answer
without it would be misled).

- Built-in tools (``web_search``, ``file_search``, ``code_interpreter``, ``computer_use``,
  ``image_generation``, ``mcp``, shells, custom tools): there is no tool server; function
  tools are served.
- ``reasoning`` (an effort or a summary) and reasoning input items: no reasoning parser
  runs, so there is no reasoning to control or to send back.
- ``background``: responses run in the request (vLLM serves it with its store enabled).
- ``include``, ``top_logprobs``: no extra output fields (logprobs) are produced.
- ``truncation="auto"``: a long conversation is a 400 (``context_length_exceeded``), not
  silently cut.
- ``prompt`` (stored prompt templates), ``conversation`` (the Conversations API),
  ``max_tool_calls`` (a limit on built-in tool calls).
"""

from __future__ import annotations

from pyengine.server.errors import bad_request
from pyengine.server.responses.protocol import ResponsesRequest

BUILT_IN_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use_preview",
                  "image_generation", "mcp", "local_shell", "shell", "custom", "apply_patch")


def check_supported(body: ResponsesRequest) -> None:
    """A 400 for the first thing ``body`` asks for that is not served (see the module)."""
    for i, tool in enumerate(body.tools or ()):
        if tool.type != "function":
            kind = "a built-in tool" if tool.type in BUILT_IN_TOOLS or tool.type.startswith("web_search") \
                else "a tool type this API does not have"
            raise bad_request(f"tools[{i}].type is {tool.type!r}, {kind}: this server runs no built-in tools "
                              "(web search, file search, code interpreter, computer use, image generation, MCP, "
                              "shells); only tools of type 'function' are served", f"tools[{i}].type",
                              "unsupported_tool")
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str) and choice.type != "function":
        raise bad_request(f"tool_choice.type {choice.type!r} is not served: tool_choice may be 'none', 'auto', "
                          "'required' or {'type': 'function', 'name': ...}", "tool_choice.type", "unsupported_tool")
    reasoning = body.reasoning or {}
    if any(reasoning.get(key) is not None for key in ("effort", "summary", "generate_summary")):
        raise bad_request("reasoning is not supported: this server runs no reasoning parser, so there is no "
                          "reasoning effort to set nor summary to return", "reasoning", "unsupported_parameter")
    unsupported = {
        "background": (body.background, "responses run within the request (there are no background responses)"),
        "include": (body.include, "no extra output fields (logprobs, search results) are produced"),
        "top_logprobs": (body.top_logprobs, "log-probabilities are not returned on this endpoint; use "
                         "/v1/chat/completions with logprobs"),
        "prompt": (body.prompt, "stored prompt templates are not kept"),
        "conversation": (body.conversation, "the Conversations API is not served; chain with "
                         "previous_response_id"),
        "max_tool_calls": (body.max_tool_calls, "it limits built-in tool calls, which are not served"),
    }
    for name, (value, why) in unsupported.items():
        if value:
            raise bad_request(f"{name} is not supported: {why}", name, "unsupported_parameter")
    if body.truncation not in (None, "disabled"):
        raise bad_request(f"truncation {body.truncation!r} is not supported: a conversation longer than the "
                          "model's context is refused (context_length_exceeded); send truncation 'disabled'",
                          "truncation", "unsupported_parameter")
