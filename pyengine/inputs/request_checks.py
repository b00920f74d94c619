"""A request built and checked once: ``build_request``, the one function both paths call.

An in-process engine (``EngineCore.add_request``, behind ``LLM`` and ``AsyncEngine``) and
the multi-process front end (before it sends, so that a bad request is refused at once,
not one round trip later) build every request with it; an engine core in another process
queues what its front end built without checking it again (``EngineCore.submit``). What
only the engine can check (bad words through its tokenizer, custom logits processors, a
grammar compiled for its scheduler) is checked there, once. The scheduler's own admission
checks (lengths against the KV pool, n against max_num_seqs) stay the final word.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional, Union

from pyengine.errors import InvalidRequestError
from pyengine.sampling_params import PoolingParams, SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """The model's limits a request is checked against (the engine's, or, in a front end,
    those its engine core reported)."""

    vocab_size: Optional[int]
    max_logprobs: int
    max_model_len: int


class BuiltRequest(NamedTuple):
    """A request ready to queue: its prompt (text as given, ids as they will run: truncated
    as asked) and its own validated copy of the parameters."""

    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: Union[SamplingParams, PoolingParams]


def build_request(prompt: Optional[str], prompt_token_ids: list[int], params: Union[SamplingParams, PoolingParams],
                  limits: RequestLimits) -> BuiltRequest:
    """Checks a request against the model's limits and builds what is queued; raises
    ``InvalidRequestError`` naming what is wrong."""
    params = checked_params(params, prompt_token_ids, limits.vocab_size, limits.max_logprobs)
    ids = truncated_prompt(prompt_token_ids, params, limits.max_model_len)
    if not ids:
        raise InvalidRequestError("prompt is empty: at least one token is needed")
    if isinstance(params, SamplingParams) and params.structured_outputs is not None and params.min_tokens:
        # Masking the end below min_tokens could leave a grammar no token at all.
        raise InvalidRequestError("min_tokens cannot be combined with structured_outputs: the constraint decides "
                                  "where the output ends")
    return BuiltRequest(prompt, list(ids), params)


def checked_params(
    params: Union[SamplingParams, PoolingParams],
    prompt_token_ids: list[int],
    vocab_size: Optional[int],
    max_logprobs: int,
) -> Union[SamplingParams, PoolingParams]:
    """A validated copy of ``params`` (fields may be set after construction); raises
    ``InvalidRequestError`` for token ids outside the vocabulary or too many logprobs."""
    params = params.checked()
    if prompt_token_ids and vocab_size is not None and max(prompt_token_ids) >= vocab_size:
        raise InvalidRequestError(
            f"prompt token id {max(prompt_token_ids)} is outside the vocabulary (size {vocab_size})"
        )
    if isinstance(params, SamplingParams):
        if params.logprobs is not None and params.logprobs > max_logprobs:
            raise InvalidRequestError(f"logprobs = {params.logprobs} exceeds max_logprobs = {max_logprobs}")
        if params.prompt_logprobs is not None:
            asked = vocab_size if params.prompt_logprobs == -1 and vocab_size is not None else params.prompt_logprobs
            if asked == -1 or asked > max_logprobs:
                raise InvalidRequestError(f"prompt_logprobs = {params.prompt_logprobs} exceeds max_logprobs = "
                                          f"{max_logprobs}")
        # Token ids are u32 in the scheduler; the model's vocabulary bounds them further.
        limit = vocab_size if vocab_size is not None else 2**32
        outside = [t for t in params.stop_token_ids or () if t >= limit]
        if outside:
            raise InvalidRequestError(f"stop_token_ids holds {outside[0]}, outside the vocabulary (size {limit})")
        for name, ids in (
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("bad_words", [t for word in params._bad_words_token_ids or () for t in word]),
        ):
            outside = [t for t in ids if t >= limit]
            if outside:
                raise InvalidRequestError(f"{name} holds token id {outside[0]}, outside the vocabulary (size {limit})")
    return params


def check_some_token_allowed(params: SamplingParams, eos_token_ids: list[int]) -> None:
    """Refuses (``InvalidRequestError``) a request whose own restrictions leave its first
    step no token to sample: every ``allowed_token_ids`` entry is a one-token bad word, or,
    with ``min_tokens``, an end token (EOS, a stop token id) that the minimum forbids.
    (What depends on the output so far, a longer bad word or a grammar, is caught per
    step by the executor, which fails only that request.)"""
    if not params.allowed_token_ids:
        return
    allowed = set(params.allowed_token_ids)
    banned = {word[0] for word in params._bad_words_token_ids or () if len(word) == 1}
    if allowed <= banned:
        raise InvalidRequestError("every token of allowed_token_ids is also a bad word: no token could be sampled")
    if params.min_tokens > 0:
        ends = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(eos_token_ids))
        if allowed <= ends | banned:
            raise InvalidRequestError(
                f"allowed_token_ids holds only end tokens (EOS or stop_token_ids) or bad words, which min_tokens = "
                f"{params.min_tokens} forbids: no token could be sampled"
            )


def truncated_prompt(prompt_token_ids: list[int], params: Union[SamplingParams, PoolingParams],
                     max_model_len: int) -> list[int]:
    """The prompt as the request runs it: with ``truncate_prompt_tokens`` = k, its last k
    tokens (-1: the last ``max_model_len``), as vLLM truncates on the left. Raises
    ``InvalidRequestError`` for k above ``max_model_len`` (vLLM refuses it too)."""
    k = getattr(params, "truncate_prompt_tokens", None)
    if k is None:
        return prompt_token_ids
    if k == -1:
        k = max_model_len
    elif k > max_model_len:
        raise InvalidRequestError(f"truncate_prompt_tokens = {k} exceeds max_model_len = {max_model_len}: "
                                  "choose a smaller truncation size")
    return prompt_token_ids[-k:] if len(prompt_token_ids) > k else prompt_token_ids


def executor_params(params: SamplingParams) -> SamplingParams:
    """The parameters the executor gets: a best_of request's candidates are ranked by their
    cumulative log-probability, so the executor computes the sampled token's (``logprobs``
    0) even when the caller asked for none; the caller still gets none."""
    if params.num_candidates > params.n and params.logprobs is None:
        return replace(params, logprobs=0)
    return params


def own_cache_salt(request_id: str, params: Union[SamplingParams, PoolingParams]) -> Optional[str]:
    """A request with prompt_logprobs needs every prompt position computed, so, as in vLLM
    V1, it does not read the prefix cache: a salt of its own keeps other requests' blocks
    from matching (blocks it computed itself still match when it is preempted and resumed,
    and their positions' entries arrived when they were computed)."""
    if isinstance(params, SamplingParams) and params.prompt_logprobs is not None:
        return f"prompt_logprobs:{request_id}:{uuid.uuid4().hex}"
    return None
