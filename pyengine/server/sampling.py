"""From request bodies to engine inputs: ``SamplingParams`` and token-id prompts, with
the checks that turn into 400s naming the request's field."""

from __future__ import annotations

from typing import Any, Optional, Union

from pyengine.errors import InvalidRequestError
from pyengine.inputs.request_checks import truncated_prompt
from pyengine.sampling_params import SamplingParams
from pyengine.server.context import ServerContext
from pyengine.server.errors import bad_request, from_value_error
from pyengine.server.protocol import SamplingFields
from pyengine.structured_outputs import StructuredOutputsParams

_OPTIONAL_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "seed", "stop", "stop_token_ids", "allowed_token_ids", "bad_words")


def sampling_params(ctx: ServerContext, req: SamplingFields, *, max_tokens: Optional[int],
                    logprobs: Optional[int], renames: Optional[dict[str, str]] = None,
                    structured_outputs: Optional[StructuredOutputsParams] = None,
                    prompt_logprobs: Optional[int] = None, best_of: Optional[int] = None) -> SamplingParams:
    """The engine's parameters for ``req``; ``renames`` maps SamplingParams' field names to
    the request's (chat: ``logprobs`` -> ``top_logprobs``). ``structured_outputs``: the
    request's constraint (``structured.py``, ``tools.py``). ``prompt_logprobs``, ``best_of``:
    completions' (vLLM's) extras."""
    renames = renames or {}
    if req.n > ctx.args.max_n:
        raise bad_request(f"n must be <= {ctx.args.max_n}, got {req.n}", "n")
    if best_of is not None and best_of > ctx.args.max_n:
        raise bad_request(f"best_of must be <= {ctx.args.max_n}, got {best_of}", "best_of")
    check_prompt_logprobs(ctx, prompt_logprobs)
    max_logprobs = ctx.engine_client.max_logprobs
    if logprobs is not None and logprobs > max_logprobs:
        raise bad_request(f"{renames.get('logprobs', 'logprobs')} must be <= {max_logprobs}, got {logprobs}",
                          renames.get("logprobs", "logprobs"))
    # The checkpoint's defaults (generation_config.json) for what the request leaves unset, as vLLM.
    kwargs: dict[str, Any] = {name: value for name, value in ctx.sampling_defaults.items() if name != "max_tokens"}
    kwargs.update({name: getattr(req, name) for name in _OPTIONAL_FIELDS if getattr(req, name) is not None})
    if isinstance(kwargs.get("stop"), list):
        kwargs["stop"] = list(kwargs["stop"])
    if req.logit_bias is not None:
        kwargs["logit_bias"] = logit_bias_ids(req.logit_bias)
    try:
        return SamplingParams(
            n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, logprobs=logprobs, structured_outputs=structured_outputs,
            prompt_logprobs=prompt_logprobs, best_of=best_of, truncate_prompt_tokens=req.truncate_prompt_tokens,
            **kwargs,
        )
    except (ValueError, OverflowError) as error:  # OverflowError: an int no engine field holds
        raise from_value_error(ValueError(str(error)), renames) from None


def logit_bias_ids(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys, so strings) with integer
    keys; a key that is not a token id is a 400 naming ``logit_bias``."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        text = key.strip()
        if not (text.isascii() and text.isdigit()):  # digits only: no sign, no "1e3", no "0x10"
            raise bad_request(f"logit_bias keys must be token ids (non-negative integers), got {key!r}", "logit_bias")
        out[int(text)] = value
    return out


def check_prompt_logprobs(ctx: ServerContext, prompt_logprobs: Optional[int]) -> None:
    """A 400 naming ``prompt_logprobs`` beyond the engine's ``max_logprobs`` (-1 asks for
    the whole vocabulary)."""
    if prompt_logprobs is None:
        return
    limit = ctx.engine_client.max_logprobs
    if prompt_logprobs < -1:
        raise bad_request(f"prompt_logprobs must be >= 0, or -1 (the whole vocabulary), got {prompt_logprobs}",
                          "prompt_logprobs")
    asked = ctx.engine_client.vocab_size if prompt_logprobs == -1 else prompt_logprobs
    if asked is None or asked > limit:
        raise bad_request(f"prompt_logprobs must be <= {limit} (the server's max_logprobs), got {prompt_logprobs}",
                          "prompt_logprobs")


def truncate_prompts(ctx: ServerContext, prompts: list[tuple[Optional[str], list[int]]],
                     params: SamplingParams) -> list[tuple[Optional[str], list[int]]]:
    """``truncate_prompt_tokens``: each prompt's last k tokens, before the length checks
    (as vLLM truncates when it tokenizes); a 400 for k above ``max_model_len``. The
    truncation is then taken off ``params``: the engine gets the prompts as they run and
    does not truncate them again."""
    if params.truncate_prompt_tokens is None:
        return prompts
    try:
        out = []
        for text, ids in prompts:
            kept = truncated_prompt(ids, params, ctx.max_model_len)
            out.append((text if len(kept) == len(ids) else None, kept))  # echo then shows what ran
    except InvalidRequestError as error:
        raise bad_request(str(error), "truncate_prompt_tokens") from None
    params.truncate_prompt_tokens = None
    return out


def default_max_tokens(ctx: ServerContext, prompt_lens: list[int]) -> int:
    """``max_tokens`` for a request that sets none: all that its longest prompt leaves of
    what one request can hold (``max_model_len``, or less with a small KV pool), at most the
    checkpoint's ``max_new_tokens`` (a default, never a cap on a request's own, as vLLM)."""
    room = max(1, ctx.max_model_len - max(prompt_lens))
    default = ctx.sampling_defaults.get("max_tokens")
    return min(room, default) if isinstance(default, int) and default >= 1 else room


def tokenize_prompts(ctx: ServerContext, prompt: Union[str, list[Any]], param: str) -> list[tuple[Optional[str], list[int]]]:
    """``prompt`` (a string, strings, token ids or lists of token ids) as (text, ids) pairs;
    at most ``max_prompts_per_request`` of them (each is an engine request)."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise bad_request(f"{param} must not be empty", param)
    limit = ctx.args.max_prompts_per_request
    if len(items) > limit:
        raise bad_request(f"{param} holds {len(items)} prompts; at most {limit} are allowed per request", param,
                          "too_many_prompts")
    out: list[tuple[Optional[str], list[int]]] = []
    vocab = ctx.engine_client.vocab_size  # ids at or beyond it would fail the whole batch's step
    for item in items:
        if isinstance(item, str):
            try:
                out.append((item, ctx.engine_client.tokenize(item)))
            except InvalidRequestError as error:
                raise bad_request(str(error), param) from None
        else:
            ids = [int(t) for t in item]
            if vocab is not None and any(t >= vocab for t in ids):
                raise bad_request(f"{param} holds token ids beyond the vocabulary ({vocab})", param)
            out.append((None, ids))
    return out


def check_length(ctx: ServerContext, prompt_len: int, max_tokens: Optional[int], prompt_param: str,
                 max_tokens_param: str = "max_tokens") -> None:
    """A 400 for an empty prompt, or one that with ``max_tokens`` exceeds ``max_model_len``."""
    limit = ctx.max_model_len
    if prompt_len == 0:
        raise bad_request(f"{prompt_param} is empty (0 tokens)", prompt_param)
    # vLLM's wording, word for word: clients parse these messages to shorten and retry.
    if prompt_len >= limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, your request has "
                          f"{prompt_len} input tokens. Please reduce the length of the input messages.",
                          prompt_param, "context_length_exceeded")
    if max_tokens is not None and prompt_len + max_tokens > limit:
        raise bad_request(f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
                          f"maximum context length is {limit} tokens and your request has {prompt_len} input "
                          f"tokens ({max_tokens} > {limit} - {prompt_len}).", max_tokens_param,
                          "context_length_exceeded")

