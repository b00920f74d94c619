"""``BeamSearchParams``: vLLM's beam-search parameters, plus transformers' ``early_stopping``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from pyengine.errors import InvalidRequestError

EarlyStopping = Union[bool, Literal["never"]]


@dataclass(slots=True)
class BeamSearchParams:
    """How to run one beam search (vLLM's fields and defaults).

    - ``beam_width``: beams kept per prompt, and sequences returned per prompt.
    - ``max_tokens``: generated tokens at most (the search ends there).
    - ``ignore_eos``: end-of-sequence tokens do not end a beam.
    - ``temperature``: 0 (the default) ranks candidates by the model's log-probabilities;
      above 0 by those of ``logits / temperature``.
    - ``length_penalty``: a finished beam scores ``cum_logprob / generated_len **
      length_penalty`` (``generated_len`` counts its tokens, the end-of-sequence token
      included, not the prompt: transformers' definition). 0 ranks by ``cum_logprob``.
    - ``include_stop_str_in_output``: keep the end-of-sequence token's text in ``text``.
    - ``early_stopping`` (transformers' ``early_stopping``, not a vLLM field): False (the
      default) stops when no live beam can beat the worst of ``beam_width`` finished ones
      at its current length; True as soon as ``beam_width`` beams have finished;
      ``"never"`` assumes live beams may still improve up to ``max_tokens``.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: EarlyStopping = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ``InvalidRequestError`` naming the first field out of range."""
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidRequestError(f"{name} must be an integer, got {value!r}")
            if value < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {value!r}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not abs(value) < float("inf"):
                raise InvalidRequestError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.early_stopping not in (True, False, "never") or not isinstance(self.early_stopping, (bool, str)):
            raise InvalidRequestError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
