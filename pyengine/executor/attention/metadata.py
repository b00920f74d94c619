"""What every attention backend needs to know about one step, built once per step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import numpy as np
import torch

from pyengine.executor.kv_cache import PagedKVCache
from pyengine.models.layers import AttentionOp


@dataclass
class StepAttentionLayout:
    """The scheduled sequences of a step, host-side (numpy) and device-side.

    ``block_tables`` holds the block table of each scheduled sequence (``[R, width]``,
    int32 on the device, width = blocks needed by the longest one); ``slot_mapping`` is
    where each token's K/V goes. With per-group tables these are table 0's, and
    ``group_layouts`` holds the others'.
    """

    query_start_loc: np.ndarray  # int [R+1]
    seq_lens: np.ndarray  # int [R]
    num_scheduled_tokens: np.ndarray  # int [R]
    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [R, width]
    block_size: int
    # A hybrid model's other per-group tables (``executor/kv_tables.py``): the same step
    # through table 1, 2, ... (their slot mappings and block tables); empty with one table.
    group_layouts: tuple["StepAttentionLayout", ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])


@dataclass
class PrefillChunk:
    """A sequence with more than one token in the step (a prompt chunk), which the
    backends attend over on its own."""

    token_start: int
    token_end: int
    seq_len: int
    block_ids: Optional[torch.Tensor]  # int64 [blocks]; None when the chunk is the whole sequence
    table: torch.Tensor  # int64 [blocks] the sequence's blocks (a windowed layer reads only some)


def prefill_chunks(layout: StepAttentionLayout) -> list[PrefillChunk]:
    """The step's sequences with more than one scheduled token, and the blocks of their
    earlier context (None when the chunk is the whole sequence so far)."""
    chunks = []
    for index in np.flatnonzero(layout.num_scheduled_tokens > 1):
        start, end = int(layout.query_start_loc[index]), int(layout.query_start_loc[index + 1])
        seq_len = int(layout.seq_lens[index])
        width = -(-seq_len // layout.block_size)
        table = layout.block_tables[index, :width].to(torch.int64)
        block_ids = table if seq_len != end - start else None  # earlier context lives in the cache
        chunks.append(PrefillChunk(start, end, seq_len, block_ids, table))
    return chunks


class AttentionBackend(Protocol):
    """A way of attending over the paged cache; ``bind`` once per step."""

    name: str

    def bind(self, cache: PagedKVCache, layout: StepAttentionLayout) -> AttentionOp:
        """The per-step operation the model layers call (``attend(layer, q, k, v)``)."""
        ...
