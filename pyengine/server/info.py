"""The operational endpoints: ``/v1/models`` (and ``/v1/models/{id}``), ``/version``,
``/health`` (and vLLM's ``/ping``), ``/metrics``."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from pyengine import __version__
from pyengine.server.context import Context, ServerContext, model_not_found
from pyengine.server.metrics import CONTENT_TYPE
from pyengine.server.protocol import ModelCard, ModelList

router = APIRouter()


def model_card(ctx: ServerContext, name: str) -> ModelCard:
    """``root`` is the served name, not the checkpoint's folder (a path tells clients
    about the host's file system); ``max_model_len`` is what one request can really
    hold, which a KV pool smaller than the model's length lowers."""
    return ModelCard(id=name, root=ctx.args.model_name, max_model_len=ctx.max_model_len)


@router.get("/v1/models")
async def list_models(ctx: Context) -> ModelList:
    """The served model, once per name it answers to."""
    return ModelList(data=[model_card(ctx, name) for name in ctx.args.model_names])


# ``:path``: a served name is often a hub id or a path ("Qwen/Qwen3-0.6B"), slashes and all.
@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, ctx: Context) -> ModelCard:
    """One model's card; another id is OpenAI's 404 ``model_not_found``."""
    if model_id not in ctx.args.model_names:
        raise model_not_found(model_id, ctx.args.model_name)
    return model_card(ctx, model_id)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/health")
@router.get("/ping")  # vLLM's (SageMaker's) name for the same check, GET or POST
@router.post("/ping")
async def health(ctx: Context) -> JSONResponse:
    """200 while the engine is alive and making progress, else 503 with the reason. With
    several engine cores, 503 as soon as one is dead; ``engines`` lists each one."""
    verdict = ctx.monitor.check()
    body = verdict.body()
    body["engines"] = [{"engine": i, "alive": h.alive, "steps": h.steps, "pending_requests": h.num_unfinished,
                        **({"reason": h.dead_reason} if h.dead_reason is not None else {})}
                       for i, h in enumerate(ctx.engine_client.engine_health())]
    return JSONResponse(body, status_code=200 if verdict.ok else 503)


@router.get("/metrics")
async def metrics(ctx: Context) -> Response:
    """Prometheus text format (rendered off the event loop: it reads the engine's stats)."""
    body = await asyncio.to_thread(ctx.metrics.render)
    return Response(body, media_type=CONTENT_TYPE)
