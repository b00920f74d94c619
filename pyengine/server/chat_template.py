"""The checkpoint's chat template for the server: ``pyengine.inputs.chat_template.ChatTemplate``
(where rendering lives, shared with ``LLM.chat``) with its failures answered as a 400 on
``messages``, never a 500."""

from __future__ import annotations

from typing import Any, Optional

from pyengine.inputs.chat_template import ChatTemplate as _ChatTemplate
from pyengine.inputs.chat_template import ChatTemplateError
from pyengine.server.errors import bad_request


class ChatTemplate(_ChatTemplate):
    """A compiled chat template; a rendering failure is the request's fault."""

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
               extra: Optional[dict[str, Any]] = None) -> str:
        try:
            return super().render(messages, add_generation_prompt, extra)
        except ChatTemplateError as error:
            raise bad_request(str(error), "messages") from None
