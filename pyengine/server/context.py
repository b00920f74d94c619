"""``ServerContext``: what every handler needs, built once per app by ``create_app``
(stored on ``app.state``; nothing lives at module level). The engine is an
``EngineClient`` and only that: the server never reaches into the engine's objects."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Optional

from fastapi import Depends, Request

from pyengine.entrypoints.engine_client import EngineClient
from pyengine.server.args import ServerArgs
from pyengine.server.errors import APIError
from pyengine.server.health import ProgressMonitor
from pyengine.server.metrics import ServerMetrics
from pyengine.server.responses.store import ResponseStore
from pyengine.text.token_pieces import TokenPieces


@dataclass
class ServerContext:
    engine_client: EngineClient  # the engine as the server sees it (never an EngineCore)
    args: ServerArgs
    metrics: ServerMetrics
    monitor: ProgressMonitor
    token_text: TokenPieces
    logger: Any
    chat_template: Optional[Any] = None  # a ChatTemplate (pyengine.inputs.chat_template), or None
    chat_template_origin: Optional[str] = None  # where it came from (choose_chat_template)
    chat_tokenizer: Optional[Any] = None  # a ChatTokenizer (user-typed special tokens stay text)
    # Default SamplingParams fields for what a request leaves unset (the checkpoint's
    # generation_config.json, as --generation-config chooses; EngineClient.generation_defaults).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    background: list[Any] = field(default_factory=list)  # asyncio tasks started by the lifespan
    # The Responses API's kept responses (previous_response_id), bounded by the args.
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(0, 0))

    @property
    def max_model_len(self) -> int:
        """What one request may hold (prompt plus generated tokens): the model's length,
        or less when the KV pool is smaller. Checks, defaults and /v1/models use it, so
        that what the server advertises is what the engine admits."""
        return self.engine_client.max_request_tokens

    def check_model(self, model: Optional[str]) -> None:
        """A request may name this server's model or none; anything else is a 404, as
        OpenAI answers it (``model_not_found``)."""
        if model is not None and model not in self.args.model_names:
            raise model_not_found(model, self.args.model_name)

    def check_alive(self) -> None:
        reason = self.engine_client.health().dead_reason
        if reason is not None:
            raise APIError(503, f"the engine cannot serve: {reason}", code="engine_dead")

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"


def model_not_found(model: str, served: str) -> APIError:
    """OpenAI's 404 for a model this server does not serve."""
    return APIError(404, f"the model {model!r} does not exist; this server serves {served!r}", "model",
                    "model_not_found")


def get_context(request: Request) -> ServerContext:
    """FastAPI dependency: the app's context."""
    return request.app.state.context


Context = Annotated[ServerContext, Depends(get_context)]
