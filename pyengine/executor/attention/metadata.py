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


def as_decode_rows(layout: StepAttentionLayout) -> StepAttentionLayout:
    """The step with every token a row of its own: the token at position ``p`` of a
    sequence reads that sequence's block table and attends to its first ``p + 1``
    positions. Once every token's K/V is in the cache (backends write them before they
    attend) that is exactly causal attention over the sequence, so a step of short
    chunks (a verification step's ``1 + d`` entries) can take the decode kernels. The
    slot mapping is the same; each group layout is expanded alike."""
    counts = layout.num_scheduled_tokens.astype(np.int64)
    tokens = int(counts.sum())
    owner = np.repeat(np.arange(len(counts)), counts)
    # A token's distance before its sequence's last token of the step.
    before_last = np.repeat(np.asarray(layout.query_start_loc[1:], dtype=np.int64), counts) - 1 - np.arange(tokens)
    seq_lens = np.repeat(np.asarray(layout.seq_lens, dtype=np.int64), counts) - before_last
    owner_t = torch.from_numpy(owner).to(layout.block_tables.device)
    return StepAttentionLayout(
        query_start_loc=np.arange(tokens + 1, dtype=np.int64),
        seq_lens=seq_lens.astype(np.asarray(layout.seq_lens).dtype),
        num_scheduled_tokens=np.ones(tokens, dtype=np.asarray(layout.num_scheduled_tokens).dtype),
        slot_mapping=layout.slot_mapping,
        block_tables=layout.block_tables.index_select(0, owner_t),
        block_size=layout.block_size,
        group_layouts=tuple(as_decode_rows(group) for group in layout.group_layouts),
    )


class AttentionBackend(Protocol):
    """A way of attending over the paged cache; ``bind`` once per step."""

    name: str

    def bind(self, cache: PagedKVCache, layout: StepAttentionLayout) -> AttentionOp:
        """The per-step operation the model layers call (``attend(layer, q, k, v)``)."""
        ...
