"""The checks a request passes before it is queued, shared by the engine core and a front
end in another process (which runs them before sending, so that a bad request is refused
at once, as an in-process engine refuses it, not one round trip later). The scheduler's
own admission checks (lengths against the KV pool, n against max_num_seqs) stay the
final word."""

from __future__ import annotations

from typing import Optional, Union

from pyengine.errors import InvalidRequestError
from pyengine.sampling_params import PoolingParams, SamplingParams


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
