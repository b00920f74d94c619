"""Which chat template the server renders with: the one place that decides.

In order, the first that exists wins:

1. ``--chat-template`` (``ServerArgs.chat_template``): the template's text, which the
   CLI read from a file or took as given (``load_chat_template``, as vLLM's flag does);
2. the checkpoint's ``chat_template.jinja``, what current transformers writes beside the
   tokenizer (and prefers over tokenizer_config.json when both are there). The model
   loader exposes only tokenizer_config.json, so the file is read here, from the
   client's ``tokenizer_path`` folder (the model's, or the ``tokenizer`` argument's);
3. ``chat_template`` in ``tokenizer_config.json`` (the client's ``chat_template``): a
   string, or a list of named templates whose "default" one counts;
4. none: chat requests answer 400.

Rendering is ``ChatTemplate``'s business (``chat_template.py``); this module only chooses
the source text, so the two can live apart."""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Optional

from pyengine.entrypoints.engine_client import EngineClient
from pyengine.inputs.chat_template import (  # noqa: F401
    TEMPLATE_FILE,
    TemplateChoice,
    checkpoint_chat_template,
    is_template_path,
)


def load_chat_template(value: str) -> str:
    """``--chat-template FILE_OR_STRING``: a readable file's text, else the value itself
    when it looks like a template (escapes such as ``\\n`` typed on a command line are
    decoded, as vLLM does). A value that looks like a path but cannot be read, or a
    template jinja2 cannot parse, is a ``ValueError`` that says so."""
    path = Path(value)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError) as error:
        if is_template_path(value):
            raise ValueError(f"--chat-template {value!r} looks like a file path, but it cannot be read "
                             f"({error.__class__.__name__}: {getattr(error, 'strerror', None) or error})") from None
        # backslashreplace keeps non-ASCII characters intact through unicode_escape.
        text = codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")
    _check_syntax(text, "--chat-template")
    return text


def select_chat_template(override: Optional[str], engine: EngineClient) -> Optional[TemplateChoice]:
    """The template the server uses (see the module's docstring for the order)."""
    if override:
        return TemplateChoice(override, "--chat-template")
    return checkpoint_chat_template(_model_folder(engine), engine.chat_template)


def _model_folder(engine: EngineClient) -> Optional[Path]:
    try:
        folder = Path(engine.tokenizer_path)
    except (TypeError, ValueError):
        return None
    return folder if folder.is_dir() else None


def _check_syntax(text: str, where: str) -> None:
    """Compiled as it will be rendered (the same environment: loop controls included)."""
    from jinja2 import TemplateSyntaxError

    from pyengine.inputs.chat_template import ChatTemplate

    try:
        ChatTemplate(text, {})
    except TemplateSyntaxError as error:
        raise ValueError(f"{where}: not a valid jinja2 template (line {error.lineno}: {error.message})") from None


__all__ = ["TemplateChoice", "load_chat_template", "checkpoint_chat_template", "select_chat_template",
           "TEMPLATE_FILE"]
