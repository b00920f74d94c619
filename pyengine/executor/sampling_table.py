"""Per-row sampling parameters of the persistent batch, on the device and mirrored on the host.

Parameters are installed once when a sequence enters a row. The sampler reads the device
tensors by row; the host (numpy) mirrors answer "does any row of this step need top-p /
penalties / a seed / logprobs?" without a device round trip, so rare features cost
nothing when unused.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pyengine.sampling_params import SamplingParams

_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


class SamplingTable:
    """Sampling parameters of every row (``max_rows`` entries each)."""

    def __init__(self, max_rows: int, device: torch.device, eos_token_ids: Sequence[int] = ()) -> None:
        self.device = device
        self.eos_token_ids = tuple(eos_token_ids)
        self.values = {name: torch.ones(max_rows, device=device) for name in _FLOAT_FIELDS}
        self.top_k = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.seed = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.greedy = np.ones(max_rows, dtype=bool)
        self.uses_top_k_top_p = np.zeros(max_rows, dtype=bool)
        self.uses_min_p = np.zeros(max_rows, dtype=bool)
        self.uses_penalties = np.zeros(max_rows, dtype=bool)
        self.has_seed = np.zeros(max_rows, dtype=bool)
        self.logprobs = np.full(max_rows, -1, dtype=np.int64)
        # min_tokens: stop tokens are masked while a row has produced fewer outputs.
        self.min_tokens = np.zeros(max_rows, dtype=np.int64)
        self.num_generated = np.zeros(max_rows, dtype=np.int64)
        # Per row, the ids masked while below min_tokens, padded with -1 (widened on demand).
        self.min_tokens_stop_ids = np.full((max_rows, 0), -1, dtype=np.int64)

    def install(self, rows: np.ndarray, params: Sequence[SamplingParams]) -> None:
        """Write the parameters of sequences entering ``rows`` (aligned with ``params``)."""
        if len(rows) == 0:
            return
        index = torch.from_numpy(rows.astype(np.int64)).to(self.device)
        for name, tensor in self.values.items():
            column = np.array([getattr(p, name) for p in params], dtype=np.float32)
            tensor[index] = torch.from_numpy(column).to(self.device)
        top_k = np.array([p.effective_top_k for p in params], dtype=np.int64)
        seeds = np.array([p.seed if p.seed is not None else 0 for p in params], dtype=np.int64)
        greedy = np.array([p.is_greedy for p in params], dtype=bool)
        self.top_k[index] = torch.from_numpy(top_k).to(self.device)
        self.seed[index] = torch.from_numpy(seeds).to(self.device)
        self.greedy[rows] = greedy
        self.uses_top_k_top_p[rows] = [p.effective_top_k > 0 or p.top_p < 1.0 for p in params]
        self.uses_min_p[rows] = [p.min_p > 0.0 for p in params]
        self.uses_penalties[rows] = [
            p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            for p in params
        ]
        self.has_seed[rows] = [p.seed is not None for p in params]
        self.logprobs[rows] = [-1 if p.logprobs is None else p.logprobs for p in params]
        self.min_tokens[rows] = [p.min_tokens for p in params]
        self.min_tokens_stop_ids[rows] = -1
        for row, p in zip(rows.tolist(), params):
            if p.min_tokens > 0:
                stop_ids = list(p.stop_token_ids or []) + ([] if p.ignore_eos else list(self.eos_token_ids))
                self._set_stop_ids(row, sorted(set(stop_ids)))

    def _set_stop_ids(self, row: int, stop_ids: list[int]) -> None:
        width = self.min_tokens_stop_ids.shape[1]
        if len(stop_ids) > width:
            extra = np.full((self.min_tokens_stop_ids.shape[0], len(stop_ids) - width), -1, dtype=np.int64)
            self.min_tokens_stop_ids = np.concatenate([self.min_tokens_stop_ids, extra], axis=1)
        self.min_tokens_stop_ids[row, : len(stop_ids)] = stop_ids

    def set_generated_counts(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """Outputs already produced by sequences entering ``rows`` (non-zero when resumed)."""
        self.num_generated[rows] = counts

    def count_samples(self, rows: np.ndarray) -> None:
        """One more output for each of ``rows`` (each row samples at most once per step)."""
        self.num_generated[rows] += 1

    def rows_below_min_tokens(self, rows: np.ndarray) -> np.ndarray:
        """Positions (into ``rows``) whose sequences must not stop yet."""
        return np.flatnonzero(self.num_generated[rows] < self.min_tokens[rows])

    def install_non_sampling(self, rows: np.ndarray) -> None:
        """Rows taken by pooling sequences: no sampling features in use."""
        self.greedy[rows] = True
        self.uses_top_k_top_p[rows] = False
        self.uses_min_p[rows] = False
        self.uses_penalties[rows] = False
        self.has_seed[rows] = False
        self.logprobs[rows] = -1
        self.min_tokens[rows] = 0
        self.min_tokens_stop_ids[rows] = -1
