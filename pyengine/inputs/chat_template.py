"""The checkpoint's chat template (``chat_template`` in tokenizer_config.json), rendered
with jinja2 in a sandbox, as Hugging Face's ``apply_chat_template`` does.

Used by ``LLM.chat`` and by the server (``pyengine/server/chat_template.py`` turns the
errors into 400s on ``messages``). The template runs over the caller's messages, so
whatever goes wrong while rendering is a ``ChatTemplateError`` (an ``InvalidRequestError``).
It may not reach the file system: an ``{% include %}``, ``{% import %}`` or
``{% extends %}`` finds nothing (an empty loader)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from jinja2 import DictLoader, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pyengine.errors import InvalidRequestError

_log = logging.getLogger("pyengine.inputs.chat_template")


class ChatTemplateError(InvalidRequestError):
    """The chat template failed on the messages it was given."""


class ChatTemplate:
    """A compiled chat template plus the special tokens templates refer to."""

    def __init__(self, source: str, tokenizer_config: dict[str, Any]) -> None:
        # As transformers compiles them: loop controls ({% break %}) and strftime_now,
        # which some templates use to print today's date.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, loader=DictLoader({}),
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        self.template = env.from_string(source)
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
