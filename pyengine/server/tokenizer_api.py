"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` (same request and response shapes).

``/tokenize`` takes a ``prompt`` or chat ``messages`` (rendered and tokenized exactly as
``/v1/chat/completions`` would, so a client can count a chat's prompt tokens) and
answers ``{"count", "max_model_len", "tokens"}`` (+ ``token_strs`` when asked);
``/detokenize`` turns ``tokens`` back into ``{"prompt"}``, special tokens kept as
Hugging Face's ``decode`` does by default. Neither needs the engine's threads. Both sit
behind the API key when one is set (``guard.py``)."""

from __future__ import annotations

from fastapi import APIRouter

from pyengine.server.chat import check_messages, render_prompt
from pyengine.server.context import Context
from pyengine.server.errors import bad_request
from pyengine.server.offload import off_the_loop_if_long, text_size
from pyengine.server.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from pyengine.server.tools import check_history

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, ctx: Context) -> TokenizeResponse:
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give either prompt or messages (exactly one of them)",
                          "messages" if body.messages is not None else "prompt")
    if body.messages is not None:
        if not body.messages:
            raise bad_request("messages must hold at least one message", "messages")
        check_messages(body.messages)
        check_history(body.messages)
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
        tokens = await off_the_loop_if_long(text_size(body.messages), render_prompt, ctx, body.messages,
                                            body.add_generation_prompt, body.chat_template_kwargs,
                                            bool(body.add_special_tokens), tools)
    else:
        assert body.prompt is not None
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = await off_the_loop_if_long(len(body.prompt), ctx.engine_client.tokenize, body.prompt, add_special)
    strs = None
    if body.return_token_strs and ctx.engine_client.tokenizer is not None:
        strs = [ctx.engine_client.tokenizer.id_to_token(t) or "" for t in tokens]
    return TokenizeResponse(count=len(tokens), max_model_len=ctx.max_model_len, tokens=tokens, token_strs=strs)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, ctx: Context) -> DetokenizeResponse:
    ctx.check_model(body.model)
    if ctx.engine_client.tokenizer is None:
        raise bad_request("this model has no tokenizer: nothing can be detokenized", "tokens")
    vocab = ctx.engine_client.vocab_size
    if vocab is not None:
        for i, token in enumerate(body.tokens):
            if token >= vocab:
                raise bad_request(f"tokens[{i}] is {token}, not a token id of this model (< {vocab})", "tokens")
    return DetokenizeResponse(prompt=ctx.engine_client.decode(body.tokens, skip_special_tokens=False))
