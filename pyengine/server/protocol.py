"""Request and response bodies of the OpenAI API (the subset pyengine serves), as pydantic
models. Requests accept vLLM's extra sampling fields (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ...); value ranges are checked by
``SamplingParams`` so that they live in one place."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, NonNegativeInt, StrictStr, model_serializer


def _utf8(value: Any) -> Any:
    """JSON may spell a lone surrogate (``"\\ud800"``); no tokenizer takes one, and the
    error it raises is no help. Refused here, with the field's location, as a 400."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(f"holds a lone surrogate at character {error.start}: not valid Unicode text") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _utf8(key)
            _utf8(item)
    elif isinstance(value, list):
        for item in value:
            _utf8(item)
    return value


Text = Annotated[StrictStr, AfterValidator(_utf8)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """``response_format.json_schema``: OpenAI's named schema (``schema`` is the JSON
    schema itself; ``strict`` asks that outputs match it exactly)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: Text
    description: Optional[Text] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``. The type
    is checked by the handler (``structured.py``), which names ``response_format.type``."""

    type: Text
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsRequest(_Request):
    """vLLM's ``structured_outputs`` extra-body object: one constraint of ``json``,
    ``regex``, ``choice``, ``grammar`` (llguidance's Lark dialect) or ``json_object``,
    plus the JSON options."""

    json_: Union[dict[str, Any], Text, None] = Field(default=None, alias="json")
    regex: Optional[Text] = None
    choice: Optional[list[Text]] = None
    grammar: Optional[Text] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[Text] = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[Text] = None

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Optional[Union[Text, list[Text]]] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # vLLM extensions
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[NonNegativeInt]] = None
    allowed_token_ids: Optional[list[NonNegativeInt]] = None
    bad_words: Optional[list[Text]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # add prompt_token_ids / token_ids to the choices
    # Beam search (vLLM's fields; completions only: server/beam_search.py)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: Union[bool, Text] = False
    truncate_prompt_tokens: Optional[int] = None  # keep the prompt's last k tokens (-1: max_model_len)
    # Constraints (structured.py): OpenAI's response_format, vLLM's structured_outputs and
    # its older guided_* spellings.
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsRequest] = None
    guided_json: Union[dict[str, Any], Text, None] = None
    guided_regex: Optional[Text] = None
    guided_choice: Optional[list[Text]] = None
    guided_grammar: Optional[Text] = None
    guided_decoding_backend: Optional[Text] = None
    guided_whitespace_pattern: Optional[Text] = None


Prompt = Union[Text, list[Text], list[NonNegativeInt], list[list[NonNegativeInt]]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    prompt_logprobs: Optional[int] = None  # vLLM's: per prompt token, the token plus this many top


class ContentPart(_Request):
    """A content part of any type: the handler answers anything but text with a 400 that
    names ``messages[i].content[j].type`` (the model takes text only), which a union of
    part models would bury in pydantic's per-member errors."""

    type: Text
    text: Optional[Text] = None


class FunctionCallIn(_Request):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it (the template gets it parsed)


class ToolCallIn(_Request):
    """A tool call of an earlier assistant turn, sent back in the history."""

    id: Optional[Text] = None
    type: Text = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    role: Text  # checked against the known roles by the handler, which names messages[i].role
    content: Union[Text, list[ContentPart], None] = None
    name: Optional[Text] = None
    tool_calls: Optional[list[ToolCallIn]] = None  # an assistant turn's calls
    tool_call_id: Optional[Text] = None  # a tool turn: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class FunctionDefinition(_Request):
    name: Text
    description: Optional[Text] = None
    parameters: Annotated[Optional[dict[str, Any]], AfterValidator(_utf8)] = None
    strict: Optional[bool] = None


class ChatTool(_Request):
    """One of ``tools``: a function the model may call (``type`` is checked by the
    handler, which names ``tools[i].type``)."""

    type: Text = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: Text


class NamedToolChoice(_Request):
    """``tool_choice={"type": "function", "function": {"name": ...}}``: call this one."""

    type: Text = "function"
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Optional[list[ChatTool]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[Any]] = None  # OpenAI's deprecated spelling of tools: refused, named
    function_call: Optional[Any] = None
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None  # vLLM's: the response's prompt_logprobs
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # vLLM's: the template writes its own
    chat_template_kwargs: Annotated[Optional[dict[str, Any]], AfterValidator(_utf8)] = None


class TokenizeRequest(_Request):
    """vLLM's ``/tokenize``: a ``prompt``, or chat ``messages`` rendered with the chat
    template. ``add_special_tokens`` defaults as vLLM's: on for a prompt, off for messages
    (the template writes its own)."""

    model: Optional[str] = None
    prompt: Optional[Text] = None
    messages: Optional[list[ChatMessage]] = None
    tools: Optional[list[ChatTool]] = None  # rendered by the chat template, as for a chat
    add_generation_prompt: bool = True
    add_special_tokens: Optional[bool] = None
    chat_template_kwargs: Annotated[Optional[dict[str, Any]], AfterValidator(_utf8)] = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[NonNegativeInt]


class EmbeddingRequest(_Request):
    model: Optional[str] = None
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None


# ---- responses ----


def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's ``Logprob`` as its server writes it in ``prompt_logprobs``."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    prompt_token_ids: Optional[list[int]] = None
    token_ids: Optional[list[int]] = None
    # vLLM's: None for the first prompt token, then token id -> Logprob per prompt token.
    prompt_logprobs: Optional[list[Optional[dict[int, PromptLogprob]]]] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class ChatLogprobTop(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogprobToken(ChatLogprobTop):
    top_logprobs: list[ChatLogprobTop] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatLogprobToken]] = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None


class _Sparse(BaseModel):
    """Serialized with only the fields it carries (a stream delta names what changed)."""

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionCallDelta(_Sparse):
    name: Optional[str] = None
    arguments: Optional[str] = None


class ToolCallDelta(_Sparse):
    """A piece of tool call ``index``: its first piece carries ``id``, ``type`` and the
    function's name; later ones carry arguments text."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[FunctionCallDelta] = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    token_ids: Optional[list[int]] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Optional[UsageInfo] = None
    prompt_token_ids: Optional[list[int]] = None
    # vLLM's: the rendered conversation's tokens, as on completions' choices.
    prompt_logprobs: Optional[list[Optional[dict[int, PromptLogprob]]]] = None


class ChatDelta(_Sparse):
    """Only what the delta carries (OpenAI sends ``role`` in the first chunk only)."""

    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCallDelta]] = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    token_ids: Optional[list[int]] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: Union[list[float], str]


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pyengine"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
