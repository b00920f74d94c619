"""``POST /v1/embeddings``: pooled, normalised hidden states (one engine request per input)."""

from __future__ import annotations

import asyncio
import base64
import struct

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from pyengine.outputs import EmbeddingRequestOutput
from pyengine.sampling_params import PoolingParams
from pyengine.server.context import Context
from pyengine.server.errors import bad_request, to_api_error
from pyengine.server.offload import off_the_loop_if_long, text_size
from pyengine.server.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, UsageInfo
from pyengine.server.sampling import check_length, tokenize_prompts

router = APIRouter()


def _encode(vector: list[float], encoding_format: str) -> object:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


@router.post("/v1/embeddings", response_model=None)
async def create_embedding(body: EmbeddingRequest, ctx: Context) -> JSONResponse:
    ctx.check_model(body.model)
    ctx.check_alive()
    if body.dimensions is not None:
        raise bad_request("dimensions is not supported (the full pooled vector is returned)", "dimensions")
    prompts = await off_the_loop_if_long(text_size(body.input), tokenize_prompts, ctx, body.input, "input")
    for _, ids in prompts:
        check_length(ctx, len(ids), None, "input")
    request_id = ctx.new_id("embd")
    tasks = [
        asyncio.ensure_future(ctx.engine_client.embed({"prompt_token_ids": ids}, PoolingParams(), f"{request_id}-{i}"))
        for i, (_, ids) in enumerate(prompts)
    ]
    try:
        results: list[EmbeddingRequestOutput] = await asyncio.gather(*tasks)
    except Exception as error:  # noqa: BLE001 - refused or failed by the engine
        raise to_api_error(error) from None
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()  # the engine request is aborted as the task unwinds
    data = [EmbeddingData(index=i, embedding=_encode(r.outputs.embedding, body.encoding_format))  # type: ignore[arg-type]
            for i, r in enumerate(results)]
    tokens = sum(len(ids) for _, ids in prompts)
    response = EmbeddingResponse(id=request_id, model=ctx.args.model_name, data=data,
                                 usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens))
    return JSONResponse(response.model_dump())
