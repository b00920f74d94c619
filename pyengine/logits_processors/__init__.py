"""Logits processors: vLLM v1's batch-level interface, and the built-in processors that
implement ``min_tokens``, ``logit_bias``, ``allowed_token_ids`` and ``bad_words`` on it.

Write a custom one by subclassing :class:`LogitsProcessor` and pass the class to the
engine (``LLM(..., logits_processors=[MyProcessor])``); see docs/logits_processors.md.
"""

from pyengine.logits_processors.allowed_tokens import AllowedTokenIdsLogitsProcessor
from pyengine.logits_processors.bad_words import BadWordsLogitsProcessor
from pyengine.logits_processors.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
    RemovedRequest,
)
from pyengine.logits_processors.logit_bias import LogitBiasLogitsProcessor
from pyengine.logits_processors.min_tokens import MinTokensLogitsProcessor

__all__ = [
    "AddedRequest",
    "AllowedTokenIdsLogitsProcessor",
    "BadWordsLogitsProcessor",
    "BatchUpdate",
    "LogitBiasLogitsProcessor",
    "LogitsProcessor",
    "MinTokensLogitsProcessor",
    "MoveDirectionality",
    "MovedRequest",
    "RemovedRequest",
]
