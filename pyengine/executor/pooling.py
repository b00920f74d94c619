"""Pooling (embedding) requests: one vector per sequence from its final hidden states."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from pyengine.sampling_params import PoolingParams


def pool_hidden_states(
    hidden: torch.Tensor, starts: np.ndarray, ends: np.ndarray, params: Sequence[PoolingParams]
) -> torch.Tensor:
    """Pooled float32 vectors ``[P, hidden]`` for the token ranges ``[starts[i], ends[i])``.

    "last" takes the last token, "cls" the first, "mean" the average (a segment sum);
    rows whose params ask for it are L2-normalised.
    """
    device = hidden.device
    kinds = np.array([p.pooling_type for p in params])
    picked = np.where(kinds == "cls", starts, ends - 1).astype(np.int64)
    pooled = hidden.index_select(0, torch.from_numpy(picked).to(device)).float()
    mean_rows = np.flatnonzero(kinds == "mean")
    if mean_rows.size:
        lengths = (ends - starts)[mean_rows].astype(np.int64)
        token_index = np.concatenate([np.arange(starts[i], ends[i]) for i in mean_rows])
        segment = np.repeat(np.arange(mean_rows.size), lengths)
        sums = torch.zeros(mean_rows.size, hidden.shape[1], device=device)
        sums.index_add_(
            0, torch.from_numpy(segment).to(device), hidden[torch.from_numpy(token_index).to(device)].float()
        )
        pooled[torch.from_numpy(mean_rows).to(device)] = sums / torch.from_numpy(lengths).to(device)[:, None]
    normalize = np.array([p.normalize for p in params], dtype=bool)
    if normalize.any():
        mask = torch.from_numpy(normalize).to(device)[:, None]
        pooled = torch.where(mask, F.normalize(pooled, dim=-1), pooled)
    return pooled
