"""The expanded form of latent attention for one prompt chunk, its memory bounded.

A chunk of ``t`` queries over ``n`` context rows (the chunk's own rows last) decompresses
the rows into per-head keys ``[W_UK c, k_rope]`` and values ``W_UV c`` and attends with
``qk_head_dim``-wide dot products (``mla_sdpa.expands`` says when that costs less). The
expansion holds ``heads x rows x (qk_head_dim + v_head_dim)`` values, 71x the latent
rows at DeepSeek-V3's sizes, so it is never made for more than ``slice_rows`` rows at once:

- ``n <= slice_rows``: one SDPA call over the whole expanded context (causal for a fresh
  prompt, the chunk's causal mask after cached context).
- longer: the context in slices of ``slice_rows`` rows, each expanded, attended by the
  queries that see any of it, in tiles of ``slice_rows`` queries, and dropped. A tile's
  partial attention comes with its log-sum-exp ``L`` (the log of its softmax
  denominator); two partials ``(o1, L1)``, ``(o2, L2)`` of the same query over disjoint
  keys merge exactly into ``(o1 e^(L1 - L) + o2 e^(L2 - L), L)`` with ``L = log(e^L1 +
  e^L2)``, so the slices' results add up to attention over the whole context. Scores,
  the log-sum-exps and the running output are float32. A query never meets a slice that
  starts past its position, so no tile has a query with every key masked.

The temporaries are then one slice's keys and values, one tile's scores and the running
output (the chunk's size), whatever the context: a chunk of ``t`` tokens after any
context needs at most what it needs after ``slice_rows`` cached rows, which is what the
memory profile runs (``MlaSdpaBackend.worst_case_context``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pyengine.executor.attention.metadata import PrefillChunk
from pyengine.models.mla import LatentQueries

# Context rows expanded at once (and queries per score tile): DeepSeek-V3's 128 heads at
# tensor parallel 1 hold 80 MiB of bfloat16 keys and values and 512 MiB of float32 scores.
DEFAULT_EXPAND_SLICE_ROWS = 1024


def attend_expanded(
    chunk: PrefillChunk, queries: LatentQueries, latent: torch.Tensor, blocks: torch.Tensor, scale: float,
    slice_rows: int = DEFAULT_EXPAND_SLICE_ROWS,
) -> torch.Tensor:
    """[chunk tokens, heads, v]: the chunk attended causally over its expanded context;
    ``latent`` is the step's rows, ``blocks`` the layer's cache (the chunk's rows written)."""
    if chunk.seq_len <= slice_rows:
        return _whole(chunk, queries, latent, blocks, scale)
    return _sliced(chunk, queries, latent, blocks, scale, slice_rows)


def _whole(
    chunk: PrefillChunk, queries: LatentQueries, latent: torch.Tensor, blocks: torch.Tensor, scale: float
) -> torch.Tensor:
    start, end = chunk.token_start, chunk.token_end
    rows = _context_rows(chunk, latent, blocks, 0, chunk.seq_len)
    if chunk.block_ids is None:
        mask, causal = None, True
    else:
        mask, causal = visible_keys(chunk.seq_len - (end - start), end - start, 0, chunk.seq_len, latent.device), False
    keys, values = queries.keys_values(rows)
    out = F.scaled_dot_product_attention(
        queries.expanded(start, end)[None], keys[None], values[None], attn_mask=mask, is_causal=causal, scale=scale
    )
    return out[0].transpose(0, 1)


def _sliced(
    chunk: PrefillChunk, queries: LatentQueries, latent: torch.Tensor, blocks: torch.Tensor, scale: float,
    size: int,
) -> torch.Tensor:
    start, end = chunk.token_start, chunk.token_end
    tokens, seq_len = end - start, chunk.seq_len
    first = seq_len - tokens  # the chunk's first position
    q = queries.expanded(start, end)  # [heads, tokens, qk_head_dim]
    heads, device = q.shape[0], q.device
    out = torch.zeros(heads, tokens, queries.w_uv.shape[1], dtype=torch.float32, device=device)
    lse = torch.full((heads, tokens), float("-inf"), dtype=torch.float32, device=device)
    for key_start in range(0, seq_len, size):
        key_end = min(key_start + size, seq_len)
        keys, values = queries.keys_values(_context_rows(chunk, latent, blocks, key_start, key_end))
        for query_start in range(max(0, key_start - first), tokens, size):  # the queries that see key_start
            query_end = min(query_start + size, tokens)
            mask = None
            if first + query_start < key_end - 1:  # the tile's first query does not see the slice's last key
                mask = visible_keys(first + query_start, query_end - query_start, key_start, key_end, device)
            part, part_lse = _partial(q[:, query_start:query_end], keys, values, mask, scale)
            _merge(out[:, query_start:query_end], lse[:, query_start:query_end], part, part_lse)
    return out.to(q.dtype).transpose(0, 1)


def _partial(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Optional[torch.Tensor], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` [heads, tq, d] over one slice: its output [heads, tq, v] and
    log-sum-exp [heads, tq], float32. Every query sees at least one key of the slice."""
    scores = torch.matmul(q, keys.transpose(1, 2)).float().mul_(scale)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = scores.sub_(lse.unsqueeze(-1)).exp_()
    return torch.matmul(probs.to(values.dtype), values).float(), lse


def _merge(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold a partial (``part``, ``part_lse``) into the running ``out`` / ``lse`` views in place."""
    total = torch.logaddexp(lse, part_lse)
    out.mul_((lse - total).exp_().unsqueeze(-1)).add_(part.mul_((part_lse - total).exp_().unsqueeze(-1)))
    lse.copy_(total)


def _context_rows(chunk: PrefillChunk, latent: torch.Tensor, blocks: torch.Tensor, row_start: int,
                  row_end: int) -> torch.Tensor:
    """Latent rows ``row_start:row_end`` of the chunk's sequence: from the step's rows for a
    fresh prompt, else from the cache's blocks (only those the rows lie in)."""
    if chunk.block_ids is None:
        return latent[chunk.token_start + row_start : chunk.token_start + row_end]
    block_size = blocks.shape[1]
    first, last = row_start // block_size, -(-row_end // block_size)
    rows = blocks.index_select(0, chunk.block_ids[first:last]).flatten(0, 1)
    offset = row_start - first * block_size
    return rows[offset : offset + row_end - row_start]


def visible_keys(query_position: int, num_queries: int, key_start: int, key_end: int,
             device: torch.device) -> torch.Tensor:
    """[queries, keys] bool: query i (at ``query_position + i``) sees the keys at or before it."""
    positions = torch.arange(query_position, query_position + num_queries, device=device)
    return torch.arange(key_start, key_end, device=device)[None, :] <= positions[:, None]
