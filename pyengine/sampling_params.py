"""Per-request generation and pooling parameters (vLLM-compatible names and defaults).

Both classes are mutable, as vLLM's are: scripts set fields after construction
(``sp.max_tokens = 16``). They are validated when built and again when a request is added
(``EngineCore.add_request`` calls ``params.checked()``, a validated copy), so a field
set to a bad value later is refused before the request is queued, naming the field. The
engine keeps its own copy: changing a params object after submitting it does not touch
requests already queued, and the executor installs each copy once into its per-row tables.
"""

from __future__ import annotations

from copy import copy
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Optional, Union

from pyengine.beam_search.params import BeamSearchParams  # vLLM's import path for it
from pyengine.errors import InvalidRequestError
from pyengine.structured_outputs import StructuredOutputsParams

__all__ = ["SamplingParams", "PoolingParams", "StructuredOutputsParams", "BeamSearchParams", "sample_params"]

_MAX_SEED = 2**63 - 1
#: Limits on a request's stop conditions (far beyond what any client sends on purpose).
MAX_STOP_TOKEN_IDS = 1024
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_CHARS = 1024
#: Limits on the logits-processor fields (docs/logits_processors.md).
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ALLOWED_TOKEN_IDS = 2**18
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 1024


@dataclass(slots=True)
class SamplingParams:
    """How to sample the tokens of one generation request.

    Semantics follow vLLM / the OpenAI API:

    - ``temperature == 0`` means greedy decoding.
    - ``top_k`` of 0 or -1 disables top-k; ``top_p == 1`` and ``min_p == 0`` disable theirs.
    - ``repetition_penalty`` (1 = off) divides positive / multiplies negative logits of every
      token seen in the prompt or the output; ``presence_penalty`` and ``frequency_penalty``
      (0 = off) subtract a constant / a count-proportional amount for tokens in the output.
    - ``seed`` makes the request's samples reproducible, independent of the other requests
      that share its batches.
    - ``logprobs``: how many top log-probabilities to return per sampled token (``None`` =
      none; 0 = only the sampled token's).
    - ``structured_outputs``: a constraint the output must match (JSON schema, regex,
      choice, grammar): see :class:`StructuredOutputsParams`.
    - ``logit_bias``: token id -> bias in [-100, 100], added to that token's logit (OpenAI).
    - ``allowed_token_ids``: only these tokens may be sampled.
    - ``bad_words``: words the output must not contain: a word's last token is forbidden
      whenever the output so far ends with the word's other tokens; each word is
      tokenized as written and with a leading space (vLLM's rule), by the engine.
    - ``extra_args``: free-form per-request arguments for custom logits processors
      (docs/logits_processors.md).
    - ``prompt_logprobs``: how many top log-probabilities to return per prompt token
      (``RequestOutput.prompt_logprobs``; -1 = the whole vocabulary); such a request's
      prompt is computed in full, never read from the prefix cache.
    - ``best_of``: generate this many samples and return the ``n`` with the highest
      cumulative log-probability (only the final output is delivered).
    - ``truncate_prompt_tokens``: keep only the last k prompt tokens (-1 = the last
      ``max_model_len``).
    See docs/logprobs.md.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: Union[None, str, list[str], tuple[str, ...]] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: Optional[int] = None
    detokenize: bool = True
    structured_outputs: Optional[StructuredOutputsParams] = None
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    extra_args: Optional[dict[str, Any]] = None
    prompt_logprobs: Optional[int] = None
    best_of: Optional[int] = None
    truncate_prompt_tokens: Optional[int] = None
    #: ``bad_words`` as token sequences, filled by the engine from its tokenizer when the
    #: request is added (vLLM's private field of the same name).
    _bad_words_token_ids: Optional[list[list[int]]] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ``InvalidRequestError`` naming the first field out of range."""
        _check(self.stop is None or isinstance(self.stop, (str, list, tuple)), "stop",
               "must be a string or a list of strings", self.stop)
        _check(self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)), "stop_token_ids",
               "must be a list of token ids", self.stop_token_ids)
        # Integers go into int64 tensors and the scheduler's counters: out of that range
        # they would overflow inside a step shared with other requests.
        for name in ("n", "top_k", "max_tokens", "min_tokens", "seed", "logprobs", "prompt_logprobs", "best_of",
                     "truncate_prompt_tokens"):
            _check_int64(name, getattr(self, name))
        for token in self.stop_token_ids or ():
            _check_int64("stop_token_ids", token)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_finite_number(value), name, "must be a finite number", value)
        _check(self.n >= 1, "n", "must be >= 1", self.n)
        _check(self.temperature >= 0.0, "temperature", "must be >= 0", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]", self.top_p)
        _check(self.top_k == -1 or self.top_k >= 0, "top_k", "must be -1, 0 (off) or >= 1", self.top_k)
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]", self.min_p)
        _check(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0", self.repetition_penalty)
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            "must be in [-2, 2]",
            self.presence_penalty,
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            "must be in [-2, 2]",
            self.frequency_penalty,
        )
        if self.seed is not None:
            # The n samples use seeds seed .. seed + n - 1.
            samples = max(self.n, self.best_of or 0)
            _check(0 <= self.seed <= _MAX_SEED - (samples - 1), "seed",
                   f"must be in [0, {_MAX_SEED - (samples - 1)}] ({samples} samples use seed .. seed + {samples - 1})",
                   self.seed)
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", "must be >= 1", self.max_tokens)
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0", self.min_tokens)
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens})",
                self.min_tokens,
            )
        if self.logprobs is not None:
            _check(self.logprobs >= 0, "logprobs", "must be >= 0", self.logprobs)
        self._validate_vllm_extras()
        if self.stop is not None and not isinstance(self.stop, str):
            for item in self.stop:
                _check(isinstance(item, str) and item != "", "stop", "must hold non-empty strings", item)
        if isinstance(self.stop, str):
            _check(self.stop != "", "stop", "must not be an empty string", self.stop)
        # Sizes: stop ids widen a per-row table and every step's mask, stop strings are
        # matched against every new piece of text.
        _check(len(self.stop_token_ids or ()) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
               f"may hold at most {MAX_STOP_TOKEN_IDS} ids", len(self.stop_token_ids or ()))
        strings = self.stop_strings
        _check(len(strings) <= MAX_STOP_STRINGS, "stop", f"may hold at most {MAX_STOP_STRINGS} strings", len(strings))
        for item in strings:
            _check(len(item) <= MAX_STOP_STRING_CHARS, "stop",
                   f"strings may be at most {MAX_STOP_STRING_CHARS} characters", len(item))
        if self.stop_token_ids is not None:
            for token in self.stop_token_ids:
                _check(isinstance(token, int) and token >= 0, "stop_token_ids", "must hold ids >= 0", token)
        if self.structured_outputs is not None:
            _check(isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
                   "must be a StructuredOutputsParams", type(self.structured_outputs).__name__)
            self.structured_outputs.validate()
        _check_processor_fields(self)

    def _validate_vllm_extras(self) -> None:
        """prompt_logprobs, best_of, truncate_prompt_tokens (vLLM's ranges)."""
        if self.prompt_logprobs is not None:
            _check(self.prompt_logprobs >= -1, "prompt_logprobs", "must be >= 0, or -1 (the whole vocabulary)",
                   self.prompt_logprobs)
        if self.best_of is not None:
            _check(self.best_of >= self.n, "best_of", f"must be >= n ({self.n})", self.best_of)
            _check(self.best_of == 1 or not self.is_greedy, "best_of",
                   "must be 1 with greedy sampling (temperature 0): every candidate would be the same", self.best_of)
        if self.truncate_prompt_tokens is not None:
            _check(self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1, "truncate_prompt_tokens",
                   "must be >= 1, or -1 (max_model_len)", self.truncate_prompt_tokens)

    @property
    def num_candidates(self) -> int:
        """Samples generated: ``best_of`` when set, else ``n``."""
        return self.best_of if self.best_of is not None else self.n

    def checked(self) -> SamplingParams:
        """A validated copy, taken when a request is added: fields may have been set after
        construction, and later changes to this object must not reach the queued request."""
        out = self.clone()
        out.validate()
        return out

    def clone(self) -> SamplingParams:
        """A copy (its ``stop`` and ``stop_token_ids`` lists copied too)."""
        out = copy(self)
        if isinstance(self.stop, list):
            out.stop = list(self.stop)
        if isinstance(self.stop_token_ids, (list, tuple)):
            out.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.structured_outputs, StructuredOutputsParams):
            out.structured_outputs = self.structured_outputs.clone()
        for name in ("logit_bias", "extra_args"):
            if isinstance(getattr(self, name), dict):
                setattr(out, name, dict(getattr(self, name)))
        for name in ("allowed_token_ids", "bad_words", "_bad_words_token_ids"):
            if isinstance(getattr(self, name), (list, tuple)):
                setattr(out, name, list(getattr(self, name)))
        return out

    @property
    def is_greedy(self) -> bool:
        """True when the request decodes greedily (temperature 0)."""
        return self.temperature < _GREEDY_EPSILON

    @property
    def effective_top_k(self) -> int:
        """top_k with both "off" spellings (0 and -1) mapped to 0."""
        return 0 if self.top_k <= 0 else self.top_k

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (empty when unset)."""
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [self.stop]
        return list(self.stop)


_GREEDY_EPSILON = 1e-5

PoolingType = Literal["last", "mean", "cls"]


@dataclass(slots=True)
class PoolingParams:
    """How to turn an embedding request's final hidden states into one vector."""

    pooling_type: PoolingType = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def checked(self) -> PoolingParams:
        """A validated copy (see ``SamplingParams.checked``)."""
        out = copy(self)
        out.validate()
        return out

    def validate(self) -> None:
        """Raises ``InvalidRequestError`` naming the field out of range."""
        _check(
            self.pooling_type in ("last", "mean", "cls"),
            "pooling_type",
            "must be one of 'last', 'mean', 'cls'",
            self.pooling_type,
        )


def _is_finite_number(value: object) -> bool:
    """A real number that the executor's float32 tables hold as a finite value."""
    if not isinstance(value, (int, float)):
        return False
    try:
        return abs(float(value)) <= _FLOAT32_MAX
    except OverflowError:
        return False


_FLOAT32_MAX = 3.4028234663852886e38


def _check_processor_fields(params: SamplingParams) -> None:
    """The fields the built-in logits processors read (their vocabulary bounds are
    checked when the request is added, ``request_checks.checked_params``)."""
    bias = params.logit_bias
    if bias is not None:
        _check(isinstance(bias, dict), "logit_bias", "must be a map of token id to bias", bias)
        _check(len(bias) <= MAX_LOGIT_BIAS_ENTRIES, "logit_bias",
               f"may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries", len(bias))
        for token, value in bias.items():
            _check(_is_token_id(token), "logit_bias", "keys must be token ids (integers >= 0)", token)
            _check(_is_finite_number(value) and not isinstance(value, bool) and -100.0 <= value <= 100.0,
                   "logit_bias", f"values must be numbers in [-100, 100] (token {token})", value)
    allowed = params.allowed_token_ids
    if allowed is not None:
        _check(isinstance(allowed, (list, tuple)), "allowed_token_ids", "must be a list of token ids", allowed)
        _check(len(allowed) > 0, "allowed_token_ids", "must not be empty", allowed)
        _check(len(allowed) <= MAX_ALLOWED_TOKEN_IDS, "allowed_token_ids",
               f"may hold at most {MAX_ALLOWED_TOKEN_IDS} ids", len(allowed))
        for token in allowed:
            _check(_is_token_id(token), "allowed_token_ids", "must hold token ids (integers >= 0)", token)
    words = params.bad_words
    if words is not None:
        _check(isinstance(words, (list, tuple)), "bad_words", "must be a list of strings", words)
        _check(len(words) <= MAX_BAD_WORDS, "bad_words", f"may hold at most {MAX_BAD_WORDS} words", len(words))
        for word in words:
            _check(isinstance(word, str) and word.strip() != "", "bad_words", "must hold non-blank strings", word)
            _check(len(word) <= MAX_BAD_WORD_CHARS, "bad_words",
                   f"words may be at most {MAX_BAD_WORD_CHARS} characters", len(word))
    if params._bad_words_token_ids is not None:
        for sequence in params._bad_words_token_ids:
            _check(isinstance(sequence, (list, tuple)) and len(sequence) > 0
                   and all(_is_token_id(t) for t in sequence), "bad_words",
                   "must tokenize to non-empty token id sequences", sequence)
    extra = params.extra_args
    if extra is not None:
        _check(isinstance(extra, dict) and all(isinstance(k, str) for k in extra), "extra_args",
               "must be a map with string keys", extra)


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32


def _check_int64(name: str, value: object) -> None:
    if value is None:
        return
    _check(isinstance(value, int) and not isinstance(value, bool), name, "must be an integer", value)
    _check(-(2**63) <= value < 2**63, name, "must fit in 64 bits", value)  # type: ignore[operator]


def _check(ok: bool, name: str, requirement: str, value: object) -> None:
    if not ok:
        raise InvalidRequestError(f"{name} {requirement}, got {value!r}")


Params = Union[SamplingParams, PoolingParams]


def sample_params(params: Params, index: int) -> Params:
    """Parameters of sample ``index``: a seeded request's samples get seeds seed, seed+1, ...
    so that they differ from each other and stay reproducible."""
    if isinstance(params, SamplingParams) and params.seed is not None and index > 0:
        return replace(params, seed=params.seed + index, n=1)
    return params
