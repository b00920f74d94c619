"""``create_app(engine, args)``: the FastAPI application around one engine.

The app owns no engine thread: the caller builds the ``AsyncEngine`` and shuts it down.
The lifespan starts the watchdog and the periodic stats logger and stops them on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Optional

from fastapi import FastAPI

from pyengine import __version__
from pyengine.entrypoints.engine_client import EngineClient
from pyengine.inputs.chat_template import ChatTemplate, choose_chat_template
from pyengine.inputs.chat_text import ChatTokenizer
from pyengine.server import chat, completions, embeddings, info, tokenizer_api
from pyengine.server.args import ServerArgs
from pyengine.server.context import ServerContext
from pyengine.server.errors import install_error_handlers
from pyengine.server.guard import GuardMiddleware
from pyengine.server.health import ProgressMonitor, Watchdog
from pyengine.server.limits import LimitsMiddleware
from pyengine.server.logs import get_logger
from pyengine.server.metrics import ServerMetrics
from pyengine.server.responses import api as responses
from pyengine.server.responses.store import ResponseStore
from pyengine.server.stats_log import log_stats_forever
from pyengine.text.token_pieces import TokenPieces


def build_context(engine: EngineClient, args: ServerArgs) -> ServerContext:
    # --chat-template, else the tokenizer folder's chat_template.jinja, else tokenizer_config's
    choice = choose_chat_template(args.chat_template, _tokenizer_folder(engine), engine.chat_template)
    return ServerContext(
        engine_client=engine,
        args=args,
        metrics=ServerMetrics(engine, args.model_name),
        monitor=ProgressMonitor(engine, args.stall_timeout),
        token_text=TokenPieces(engine.tokenizer, engine.token_bytes),
        logger=get_logger(model=args.model_name),
        chat_template=ChatTemplate(choice.source, engine.tokenizer_config, f"the {choice.origin} chat template")
        if choice is not None else None,
        chat_template_origin=choice.origin if choice is not None else None,
        chat_tokenizer=ChatTokenizer(engine.tokenizer) if engine.tokenizer is not None else None,
        sampling_defaults=engine.generation_defaults,
        responses=ResponseStore(args.responses_store_size, args.responses_store_max_bytes),
    )


def _tokenizer_folder(engine: EngineClient) -> Optional[Path]:
    try:
        folder = Path(engine.tokenizer_path)
    except (TypeError, ValueError):
        return None
    return folder if folder.is_dir() else None


def create_app(engine: EngineClient, args: ServerArgs) -> FastAPI:
    """The OpenAI-compatible app serving ``engine`` (an ``AsyncEngine``, or any other
    ``EngineClient``) under ``args.model_name``."""
    ctx = build_context(engine, args)
    watchdog = Watchdog(ctx.monitor, args.watchdog_interval, ctx.logger)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        ctx.background.append(asyncio.ensure_future(watchdog.run()))
        if args.stats_interval > 0:
            ctx.background.append(asyncio.ensure_future(log_stats_forever(ctx, args.stats_interval)))
        ctx.logger.info("server ready", model_path=ctx.engine_client.model_path, max_model_len=ctx.max_model_len,
                        chat_template=ctx.chat_template_origin, api_key=args.api_key is not None)
        if ctx.sampling_defaults:  # vLLM says so too: answers differ from the plain defaults
            ctx.logger.info("sampling defaults from the checkpoint's generation_config.json (requests that set "
                            "a field override it; --generation-config vllm ignores them)",
                            **ctx.sampling_defaults)
        try:
            yield
        finally:
            for task in ctx.background:
                task.cancel()
            await asyncio.gather(*ctx.background, return_exceptions=True)
            ctx.background.clear()

    # The interactive docs describe the server to anyone who asks: off unless enabled,
    # and then behind the API key (GuardMiddleware) like /v1/*.
    docs = {} if args.enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="pyengine", version=__version__, lifespan=lifespan, **docs)
    app.state.context = ctx
    app.state.watchdog = watchdog
    install_error_handlers(app)
    for module in (completions, chat, responses, embeddings, info, tokenizer_api):
        app.include_router(module.router)

    app.add_middleware(LimitsMiddleware, args=args)  # inside the guard: its refusals are counted
    app.add_middleware(GuardMiddleware, api_key=args.api_key, errors=ctx.metrics.http_errors,
                       model_name=args.model_name)
    return app


__all__ = ["create_app", "build_context"]
