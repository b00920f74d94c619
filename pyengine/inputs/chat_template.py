"""How a chat becomes a prompt: the one module ``LLM.chat`` and the server both render
through (``render_chat``).

The checkpoint's chat template (``chat_template.jinja``, else ``chat_template`` in
tokenizer_config.json; ``checkpoint_chat_template``) or a given one (a file or its text:
``load_chat_template``, vLLM's ``--chat-template`` rule) is rendered with jinja2 in a
sandbox, as Hugging Face's ``apply_chat_template`` does, over the messages as templates
read them (``template_messages``: text parts joined with newlines, tool calls' arguments
parsed). Special tokens typed inside the messages stay text (``chat_text.py``), so a
message cannot forge a turn.

The template runs over the caller's messages, so whatever goes wrong while rendering is
a ``ChatTemplateError`` (an ``InvalidRequestError``; the server answers it with a 400 on
``messages``). It may not reach the file system: an ``{% include %}``, ``{% import %}``
or ``{% extends %}`` finds nothing (an empty loader)."""

from __future__ import annotations

import codecs
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from jinja2 import DictLoader, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pyengine.errors import InvalidRequestError
from pyengine.inputs.chat_text import ChatTokenizer

_log = logging.getLogger("pyengine.inputs.chat_template")


class ChatTemplateError(InvalidRequestError):
    """The chat template failed on the messages it was given."""


class ChatTemplate:
    """A compiled chat template plus the special tokens templates refer to."""

    def __init__(self, source: str, tokenizer_config: dict[str, Any], what: str = "the chat template") -> None:
        """``what`` names the template in the error a syntax error raises."""
        # As transformers compiles them: loop controls ({% break %}) and strftime_now,
        # which some templates use to print today's date.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, loader=DictLoader({}),
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        try:
            self.template = env.from_string(source)
        except TemplateSyntaxError as error:
            raise ChatTemplateError(f"{what} does not compile: not a valid jinja2 template "
                                    f"(line {error.lineno}: {error.message})") from None
        except TemplateError as error:
            raise ChatTemplateError(f"{what} does not compile: {error}") from None
        self.special = {name: _token_text(tokenizer_config.get(name))
                        for name in ("bos_token", "eos_token", "pad_token", "unk_token")}

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
               extra: Optional[dict[str, Any]] = None) -> str:
        """The prompt text. Raises ``ChatTemplateError`` when the template fails."""
        try:
            # One merged context: the caller's own keys may not collide with ours.
            context = {**self.special, **(extra or {}), "messages": messages,
                       "add_generation_prompt": add_generation_prompt}
            return self.template.render(**context)
        except TemplateError as error:
            raise ChatTemplateError(f"the chat template failed on these messages: {error}") from error
        except Exception as error:  # noqa: BLE001 - the template's own code, over the caller's data
            _log.warning("chat template raised %r", error)
            raise ChatTemplateError(f"the chat template failed on these messages ({type(error).__name__})") \
                from error


def template_tool_calls(tool_calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant turn's tool calls as templates expect them: each call's ``arguments``
    (JSON text in OpenAI's API) parsed into a dict, as vLLM and transformers pass them (the
    Qwen and Llama templates write ``arguments | tojson``, which would quote text twice).
    ``where`` names the calls in errors (``messages[2].tool_calls``)."""
    if not isinstance(tool_calls, (list, tuple)):
        raise InvalidRequestError(f"{where} must be a list of tool calls")
    out = []
    for j, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(f"{where}[{j}] must be a tool call "
                                      "({'type': 'function', 'function': {'name': ..., 'arguments': ...}})")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as error:
                raise InvalidRequestError(f"{where}[{j}].function.arguments is not valid JSON: {error}") from None
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Optional[tuple[str, str]] = None, sort_keys: bool = False) -> str:
    """JSON as templates expect it (as transformers renders them): text kept as it is, not
    \\u-escaped or HTML-escaped, so tool schemas read naturally and a placeholder that
    stands for a client's typed special token survives the rendering."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _token_text(token: Any) -> str:
    if isinstance(token, dict):  # {"content": "<s>", ...}
        return str(token.get("content", ""))
    return "" if token is None else str(token)


#: What current transformers writes beside the tokenizer (and prefers over
#: tokenizer_config.json's entry when both are there).
TEMPLATE_FILE = "chat_template.jinja"


@dataclass(frozen=True)
class TemplateChoice:
    source: str  # the jinja2 text
    origin: str  # "--chat-template", "chat_template.jinja" or "tokenizer_config.json"


def checkpoint_chat_template(folder: Optional[Path], raw_config_template: Any) -> Optional[TemplateChoice]:
    """The checkpoint's own template: ``chat_template.jinja`` in ``folder``, else the
    tokenizer_config.json entry ``raw_config_template`` (a string or named templates)."""
    if folder is not None:
        file = folder / TEMPLATE_FILE
        if file.is_file():
            text = file.read_text(encoding="utf-8")
            if text.strip():
                return TemplateChoice(text, TEMPLATE_FILE)
    source = raw_config_template
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if isinstance(source, str) and source:
        return TemplateChoice(source, "tokenizer_config.json")
    return None


def is_template_path(value: str) -> bool:
    """vLLM's rule for "a chat template given as a file or as its text": text with none of
    ``{``, ``}`` or a newline is a path."""
    return not any(c in value for c in "{}\n")


def load_chat_template(value: str, what: str = "--chat-template") -> str:
    """A chat template given as a file or as its text (``--chat-template``, and
    ``LLM.chat(chat_template=)``): a readable file's text, else the value itself when it
    looks like a template, with escapes such as ``\\n`` decoded (typed on a command
    line; vLLM decodes them too). A value that looks like a path but cannot be read, or a
    template jinja2 cannot parse, is a ``ChatTemplateError`` (a ``ValueError``) naming
    ``what``."""
    try:
        text = Path(value).expanduser().read_text(encoding="utf-8")
    except (OSError, ValueError) as error:
        if is_template_path(value):
            raise ChatTemplateError(
                f"{what} {value!r} looks like a file path, but it cannot be read "
                f"({error.__class__.__name__}: {getattr(error, 'strerror', None) or error})") from None
        # backslashreplace keeps non-ASCII characters intact through unicode_escape.
        text = codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")
    ChatTemplate(text, {}, what)  # compiled as it will be rendered: a syntax error now, naming the flag
    return text


def choose_chat_template(given: Optional[str], folder: Optional[Path], raw_config_template: Any) -> \
        Optional[TemplateChoice]:
    """Which template renders; the first that exists wins:

    1. ``given``, a template's text (``--chat-template``, read by ``load_chat_template``);
    2. the checkpoint's ``chat_template.jinja`` in ``folder`` (the tokenizer's folder: the
       model's, or the ``tokenizer`` argument's), what current transformers writes beside
       the tokenizer and prefers over tokenizer_config.json;
    3. ``chat_template`` in tokenizer_config.json (``raw_config_template``): a string, or
       a list of named templates whose "default" one counts;
    4. none (None): chats are refused."""
    if given:
        return TemplateChoice(given, "--chat-template")
    return checkpoint_chat_template(folder, raw_config_template)


# ---- messages ----


def template_messages(conversation: Any, keep_parts: bool = False, where: str = "messages") -> list[dict[str, Any]]:
    """The conversation as the template sees it: plain dicts, text content (a list of text
    parts joined with newlines, as vLLM joins them, unless ``keep_parts``; no content is
    ""), tool calls' JSON-text arguments parsed (``template_tool_calls``). ``where`` names
    the conversation in errors."""
    if isinstance(conversation, (str, bytes, Mapping)) or not isinstance(conversation, Sequence):
        raise InvalidRequestError(f"{where} must be a list of {{'role', 'content'}} dicts, "
                                  f"got {type(conversation).__name__}")
    out = []
    for i, message in enumerate(conversation):
        if not isinstance(message, Mapping) or "role" not in message:
            raise InvalidRequestError(f"{where}[{i}] must be a dict with a 'role', got {message!r:.80}")
        message = dict(message)
        content = message.get("content")
        if content is None:
            message["content"] = [] if keep_parts else ""
        elif isinstance(content, Sequence) and not isinstance(content, str):
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequestError(f"{where}[{i}].content[{j}] must be a text part "
                                              f"({{'type': 'text', 'text': ...}}): the model takes text only")
                parts.append(dict(part))
            message["content"] = parts if keep_parts else "\n".join(p["text"] for p in parts)
        elif not isinstance(content, str):
            raise InvalidRequestError(f"{where}[{i}].content must be a string or a list of text parts")
        if message.get("tool_calls"):
            message["tool_calls"] = template_tool_calls(message["tool_calls"], f"{where}[{i}].tool_calls")
        out.append(message)
    return out


@dataclass(frozen=True)
class RenderedChat:
    text: str  # the prompt as rendered, special tokens typed in the messages as typed
    token_ids: list[int]


def render_chat(template: ChatTemplate, tokens: ChatTokenizer, conversation: Any, *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: Optional[list[dict[str, Any]]] = None, template_kwargs: Optional[dict[str, Any]] = None,
                add_special_tokens: bool = False, keep_parts: bool = False,
                where: str = "messages") -> RenderedChat:
    """A conversation's prompt: rendered by ``template`` with ``tools`` (None: no tools, as
    transformers passes it), ``documents`` None and the caller's ``template_kwargs`` (which
    win, as vLLM merges them), then tokenized by ``tokens`` so that only the template's own
    special tokens are control tokens. ``continue_final_message`` ends the prompt inside
    the last message (transformers' rule), so the model continues it. ``add_special_tokens``:
    also what the tokenizer adds around a text (a BOS), off since templates write their own."""
    escapes = tokens.session()
    chat = escapes.escape(template_messages(conversation, keep_parts, where))
    extra = escapes.escape({"tools": tools, "documents": None, **(template_kwargs or {})})
    text = template.render(chat, add_generation_prompt, extra)
    if continue_final_message:
        text = _cut_after_final_message(text, chat)
    return RenderedChat(escapes.restore(text), escapes.encode(text, add_special_tokens))


def _cut_after_final_message(text: str, chat: list[dict[str, Any]]) -> str:
    """The rendered chat cut right after the final message's text (transformers'
    ``continue_final_message``): the template's end-of-turn marker goes."""
    final = chat[-1].get("content") if chat else None
    if isinstance(final, list):
        final = next((p["text"] for p in reversed(final) if "text" in p), None)
    if not isinstance(final, str) or not final.strip():
        raise InvalidRequestError("continue_final_message is set but the final message has no text to continue")
    if final.strip() not in text:
        raise InvalidRequestError("continue_final_message is set but the final message does not appear in the "
                                  "rendered chat (the template changes it)")
    at = text.rindex(final.strip())
    if text[at:at + len(final.lstrip())] == final:  # the template kept its spacing
        return text[:at + len(final.lstrip())]
    return text[:at + len(final.strip())]
