"""The operational endpoints: ``/v1/models``, ``/version``, ``/health``, ``/metrics``."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from pyengine import __version__
from pyengine.server.context import Context
from pyengine.server.metrics import CONTENT_TYPE
from pyengine.server.protocol import ModelCard, ModelList

router = APIRouter()


@router.get("/v1/models")
async def list_models(ctx: Context) -> ModelList:
    """The served model. ``root`` is its served name, not the checkpoint's folder (a path
    tells clients about the host's file system); ``max_model_len`` is what one request
    can really hold, which a KV pool smaller than the model's length lowers."""
    card = ModelCard(id=ctx.args.model_name, root=ctx.args.model_name, max_model_len=ctx.max_model_len)
    return ModelList(data=[card])


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/health")
async def health(ctx: Context) -> JSONResponse:
    """200 while the engine is alive and making progress, else 503 with the reason."""
    verdict = ctx.monitor.check()
    return JSONResponse(verdict.body(), status_code=200 if verdict.ok else 503)


@router.get("/metrics")
async def metrics(ctx: Context) -> Response:
    """Prometheus text format (rendered off the event loop: it reads the engine's stats)."""
    body = await asyncio.to_thread(ctx.metrics.render)
    return Response(body, media_type=CONTENT_TYPE)
