"""logit_bias: a per-request map of token id -> bias added to the logit (OpenAI / vLLM)."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from pyengine.logits_processors.index_state import update_entries
from pyengine.logits_processors.interface import BatchUpdate, LogitsProcessor


class LogitBiasLogitsProcessor(LogitsProcessor):
    """The biases of every biased index, flattened into (index, token, bias) tensors when
    the batch changes; each step adds them in one indexed write."""

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        self.biases: dict[int, dict[int, float]] = {}
        self._flat: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None
        self._cached: Optional[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = None

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        if update_entries(self.biases, batch_update, lambda params, _p, _o: params.logit_bias or None):
            self._flat, self._cached = None, None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.biases:
            return logits
        n = logits.shape[0]
        if self._cached is None or self._cached[0] != n:
            self._cached = (n, *self._tensors(n, logits.device))
        _, rows, tokens, values = self._cached
        if rows.numel():
            logits[rows, tokens] += values
        return logits

    def _tensors(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._flat is None:
            items = [(i, t, b) for i, bias in self.biases.items() for t, b in bias.items()]
            self._flat = (
                np.array([i for i, _, _ in items], dtype=np.int64),
                np.array([t for _, t, _ in items], dtype=np.int64),
                np.array([b for _, _, b in items], dtype=np.float32),
            )
        index, token, bias = self._flat
        keep = index < n  # indices past the step's samples sample nothing this step
        return tuple(torch.from_numpy(a[keep]).to(device) for a in (index, token, bias))  # type: ignore[return-value]
