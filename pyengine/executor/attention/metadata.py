"""What every attention backend needs to know about one step, built once per step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from pyengine.executor.kv_cache import PagedKVCache
from pyengine.models.layers import AttentionOp


@dataclass
class StepAttentionLayout:
    """The scheduled sequences of a step, host-side (numpy) and device-side.

    ``block_tables`` holds the block table of each scheduled sequence (``[R, width]``,
    int32 on the device, width = blocks needed by the longest one); ``slot_mapping`` is
    where each token's K/V goes.
    """

    query_start_loc: np.ndarray  # int [R+1]
    seq_lens: np.ndarray  # int [R]
    num_scheduled_tokens: np.ndarray  # int [R]
    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [R, width]
    block_size: int

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])


class AttentionBackend(Protocol):
    """A way of attending over the paged cache; ``bind`` once per step."""

    name: str

    def bind(self, cache: PagedKVCache, layout: StepAttentionLayout) -> AttentionOp:
        """The per-step operation the model layers call (``attend(layer, q, k, v)``)."""
        ...
