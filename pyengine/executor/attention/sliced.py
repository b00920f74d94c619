"""Causal attention of a prompt chunk over a long context, a slice of the context at a
time, its memory bounded whatever the context's length.

A chunk of ``t`` queries (positions ``first .. first + t``) over ``n`` context rows
attended in one call holds the whole context's keys and values and, where the kernel
materializes them, ``heads x t x n`` scores. Here the context goes in slices of ``size``
rows: each slice's keys and values are made (gathered from the cache, or expanded), the
queries that see any of it attend in tiles of ``size`` queries, and the slice is dropped.
A tile's partial attention comes with its log-sum-exp ``L`` (the log of its softmax
denominator); two partials ``(o1, L1)``, ``(o2, L2)`` of the same query over disjoint
keys merge exactly into ``(o1 e^(L1 - L) + o2 e^(L2 - L), L)`` with ``L = log(e^L1 +
e^L2)``, so the slices' results add up to attention over the whole context. Scores, the
log-sum-exps and the running output are float32. A query never meets a slice that starts
past its position, so no tile has a query with every key masked.

The temporaries are then one slice's keys and values, one tile's ``heads x size x size``
scores and the running output (the chunk's size), whatever the context: a chunk of ``t``
tokens after any context holds at most what it holds after ``size`` cached rows, which
is what the memory profile runs (``MlaSdpaBackend.profile_steps``,
``SdpaBackend.profile_steps``). Used by latent attention's two forms (``mla_chunk.py``)
and by the plain SDPA backend's chunks after cached context (``sdpa.py``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from pyengine.executor.attention.windowed import window_mask

# Context rows attended at once (and queries per score tile). DeepSeek-V3's 128 heads at
# tensor parallel 1: 512 MiB of float32 scores a tile; expanded, 80 MiB of bfloat16 keys
# and values a slice.
DEFAULT_SLICE_ROWS = 1024

# Keys [B, rows, d] and values [B, rows, v] of context rows (start, end).
KeysValues = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


def attend_in_slices(
    q: torch.Tensor, keys_values: KeysValues, first: int, seq_len: int, value_dim: int, scale: float,
    size: int = DEFAULT_SLICE_ROWS, softcap: Optional[float] = None,
) -> torch.Tensor:
    """``q`` [B, G, t, d]: the queries at positions ``first .. first + t`` of a sequence of
    ``seq_len`` rows (``first + t == seq_len``), ``G`` of them per key "head" ``B``
    (grouped queries; latent attention's absorbed form is ``B = 1``, its expanded one
    ``G = 1``), attended causally over the sequence's rows, which ``keys_values`` makes
    at most ``size`` rows at a time. ``softcap``: scores capped ``cap * tanh(score / cap)``
    (Gemma 2). Returns [B, G, t, value_dim] in ``q``'s dtype."""
    tokens, device = q.shape[2], q.device
    out = torch.zeros(q.shape[:3] + (value_dim,), dtype=torch.float32, device=device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=device)
    for key_start in range(0, seq_len, size):
        key_end = min(key_start + size, seq_len)
        keys, values = keys_values(key_start, key_end)
        for query_start in range(max(0, key_start - first), tokens, size):  # the queries that see key_start
            query_end = min(query_start + size, tokens)
            mask = None
            if first + query_start < key_end - 1:  # the tile's first query does not see the slice's last key
                mask = window_mask(first + query_start, query_end - query_start, key_start, key_end - key_start,
                                   device, None)
            part, part_lse = _partial(q[:, :, query_start:query_end], keys, values, mask, scale, softcap)
            _merge(out[:, :, query_start:query_end], lse[:, :, query_start:query_end], part, part_lse)
    return out.to(q.dtype)


def _partial(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
    softcap: Optional[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` [B, G, tq, d] over one slice (keys [B, L, d], values [B, L, v]):
    its output [B, G, tq, v] and log-sum-exp [B, G, tq], float32. Every query sees at
    least one key of the slice. A group's queries are one batch of rows (``bmm``, no
    broadcast copies of the keys); the output is divided by the softmax's denominator
    after the values, over ``v`` columns instead of the slice's ``L``."""
    batch, group, tq, dim = q.shape
    rows = q.reshape(batch, group * tq, dim)
    scores = torch.bmm(rows, keys.transpose(1, 2)).float().mul_(scale).view(batch, group, tq, -1)
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    weights = scores.sub_(top).exp_()
    denominator = weights.sum(dim=-1, keepdim=True)
    part = torch.bmm(weights.view(batch, group * tq, -1).to(values.dtype), values).float()
    part = part.view(batch, group, tq, -1).div_(denominator)
    return part, top.squeeze(-1).add_(denominator.log_().squeeze(-1))


def _merge(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold a partial (``part``, ``part_lse``) into the running ``out`` / ``lse`` views in place."""
    total = torch.logaddexp(lse, part_lse)
    out.mul_((lse - total).exp_().unsqueeze(-1)).add_(part.mul_((part_lse - total).exp_().unsqueeze(-1)))
    lse.copy_(total)


def cached_rows(blocks: torch.Tensor, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows ``start:end`` of a sequence from a layer's paged cache ``blocks`` [blocks,
    block_size, ...] and its block ids ``table`` (int64): [end - start, ...], gathered from
    only the blocks the rows lie in."""
    block_size = blocks.shape[1]
    first, last = start // block_size, -(-end // block_size)
    rows = blocks.index_select(0, table[first:last]).flatten(0, 1)
    offset = start - first * block_size
    return rows[offset : offset + end - start]
