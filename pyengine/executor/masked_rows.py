"""Rows left with no token to sample: every logit ``-inf`` after the logits processors
and the grammar mask (``allowed_token_ids`` against a grammar or a longer bad word, a
grammar whose only continuation is a bad word, a custom processor that masks all).

Sampling such a row would silently produce a garbage token (argmax of all ``-inf`` is
token 0). The executor checks the rows that can get there (those with a restricting
processor field, a grammar, or every row when a custom processor is installed) and fails
only their requests. The check reads only those rows: nothing for a step without them.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

NO_TOKEN_LEFT = (
    "no token can be sampled: allowed_token_ids, bad_words, min_tokens, the structured output's grammar "
    "or a logits processor masked every token of the vocabulary"
)


def fail_fully_masked(logits: torch.Tensor, samples: np.ndarray, on_failure: Callable[[int, str], None]) -> None:
    """Reports each of ``samples`` (indices into ``logits``' rows) whose logits are all
    ``-inf`` through ``on_failure(index, message)`` and gives it zero logits, so that the
    step samples something well defined for it (discarded: its request is failed)."""
    if not samples.size:
        return
    if samples.size == logits.shape[0]:
        samples = np.arange(logits.shape[0], dtype=np.int64)
        best = logits.amax(dim=-1)
    else:
        best = logits.index_select(0, torch.from_numpy(samples).to(logits.device)).amax(dim=-1)
    dead = torch.isneginf(best)
    if not bool(dead.any()):
        return
    dead_samples = samples[dead.cpu().numpy()]
    for i in dead_samples.tolist():
        on_failure(int(i), NO_TOKEN_LEFT)
    logits[torch.from_numpy(dead_samples).to(logits.device)] = 0.0
