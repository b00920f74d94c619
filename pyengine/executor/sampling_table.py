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

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.device = device
        self.values = {name: torch.ones(max_rows, device=device) for name in _FLOAT_FIELDS}
        self.top_k = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.seed = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.greedy = np.ones(max_rows, dtype=bool)
        self.uses_top_k_top_p = np.zeros(max_rows, dtype=bool)
        self.uses_min_p = np.zeros(max_rows, dtype=bool)
        self.uses_penalties = np.zeros(max_rows, dtype=bool)
        self.has_seed = np.zeros(max_rows, dtype=bool)
        self.logprobs = np.full(max_rows, -1, dtype=np.int64)

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

    def install_non_sampling(self, rows: np.ndarray) -> None:
        """Rows taken by pooling sequences: no sampling features in use."""
        self.greedy[rows] = True
        self.uses_top_k_top_p[rows] = False
        self.uses_min_p[rows] = False
        self.uses_penalties[rows] = False
        self.has_seed[rows] = False
        self.logprobs[rows] = -1
