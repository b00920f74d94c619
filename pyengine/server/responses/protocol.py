"""The Responses API's bodies (``POST /v1/responses``), the subset pyengine serves, as
pydantic models: the request, its input items and tools, and the response object with
its output items. Fields this server does not serve are declared so that the handler can
refuse them by name (``unsupported.py``) instead of ignoring what a client asked for;
unknown fields are ignored, as on the other endpoints. The streamed events are in
``events.py``."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from pyengine.server.protocol import Text, _Request, _utf8

# ---- request ----


class ResponseContentPart(_Request):
    """A part of a message's content: ``input_text`` / ``output_text`` are served; any other
    type (an image, a file, audio) is refused by the converter, which names its place."""

    type: Text
    text: Optional[Text] = None


class InputItem(_Request):
    """One item of ``input``: a message (``type`` "message" or absent, with ``role`` and
    ``content``), a ``function_call`` an earlier turn made, or the ``function_call_output``
    answering it. Which fields an item needs depends on its type, so the converter checks
    them (naming ``input[i].field``) rather than a union pydantic would report as a wall
    of per-member errors."""

    type: Optional[Text] = None
    role: Optional[Text] = None
    content: Union[Text, list[ResponseContentPart], None] = None
    id: Optional[Text] = None
    call_id: Optional[Text] = None
    name: Optional[Text] = None
    arguments: Optional[Text] = None  # JSON text, as a function_call carries it
    output: Union[Text, list[ResponseContentPart], None] = None
    status: Optional[Text] = None


class FunctionTool(_Request):
    """One of ``tools``. The Responses API spells a function tool flat (``name``,
    ``parameters`` beside ``type``); the built-in tools (``web_search``, ``file_search``,
    ...) share the list and are refused by name."""

    type: Text
    name: Optional[Text] = None
    description: Optional[Text] = None
    parameters: Annotated[Optional[dict[str, Any]], AfterValidator(_utf8)] = None
    strict: Optional[bool] = None


class ToolChoiceObject(_Request):
    """``{"type": "function", "name": ...}``: call this function. Other types (a built-in
    tool, ``allowed_tools``, ``mcp``) are refused by name."""

    type: Text
    name: Optional[Text] = None


ToolChoice = Union[Literal["none", "auto", "required"], ToolChoiceObject]


class TextFormat(_Request):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with the schema
    beside ``type`` (flat, unlike chat's ``response_format.json_schema``)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Text
    name: Optional[Text] = None
    description: Optional[Text] = None
    json_schema: Annotated[Optional[dict[str, Any]], AfterValidator(_utf8)] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class TextConfig(_Request):
    format: Optional[TextFormat] = None
    verbosity: Optional[Text] = None


class ResponsesRequest(_Request):
    model: Optional[str] = None
    input: Union[Text, list[InputItem]]
    instructions: Optional[Text] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    text: Optional[TextConfig] = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None
    previous_response_id: Optional[Text] = None
    store: bool = True
    stream: bool = False
    metadata: Optional[dict[str, Text]] = None
    user: Optional[str] = None
    service_tier: Optional[str] = None  # accepted and ignored: one tier here
    # Declared to be refused by name (unsupported.py), never silently dropped.
    reasoning: Optional[dict[str, Any]] = None
    background: Optional[bool] = None
    include: Optional[list[str]] = None
    top_logprobs: Optional[int] = None
    truncation: Optional[str] = None
    prompt: Optional[Any] = None
    conversation: Optional[Any] = None
    max_tool_calls: Optional[int] = None


# ---- response ----


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: str = "completed"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


OutputItem = Union[OutputMessage, FunctionCallItem]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # no reasoning parser runs: always 0, truly


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: str  # "max_output_tokens"


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """The response object, as ``POST`` returns it, ``GET /v1/responses/{id}`` returns it
    again and the stream's lifecycle events carry it."""

    id: str
    object: Literal["response"] = "response"
    created_at: float = Field(default_factory=time.time)
    status: str
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: Optional[ResponseUsage] = None
    error: Optional[ResponseError] = None
    incomplete_details: Optional[IncompleteDetails] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    parallel_tool_calls: bool = True
    previous_response_id: Optional[str] = None
    store: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: str = "disabled"
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    background: bool = False
    reasoning: Optional[dict[str, Any]] = None
    service_tier: str = "default"
