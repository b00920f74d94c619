"""Latent attention of one prompt chunk over its context, in either form, its memory
bounded whatever the context.

A chunk of ``t`` queries over ``n`` context rows (the chunk's own rows last) is attended
in one of two forms (``mla_sdpa.expands`` says which costs less):

- absorbed: the queries in latent space (``W_UK`` folded in) against the latent rows as
  cached, one key "head" shared by every query head, the key the whole row
  (``kv_lora_rank + qk_rope_head_dim``) and the value its first ``kv_lora_rank`` values;
  nothing is expanded, but the ``heads x t x n`` scores grow with the context.
- expanded: the rows decompressed into per-head keys ``[W_UK c, k_rope]`` and values
  ``W_UV c`` (``LatentQueries.keys_values``) and attended with ``qk_head_dim``-wide dot
  products; the expansion holds ``heads x rows x (qk_head_dim + v_head_dim)`` values,
  71x the latent rows at DeepSeek-V3's sizes.

Either way a context of at most ``slice_rows`` rows is attended in one SDPA call (causal
for a fresh prompt, the chunk's causal mask after cached context); a longer one a slice
of ``slice_rows`` rows at a time, the slices' partial attentions merged by their
log-sum-exps (``sliced.attend_in_slices``), so neither form holds more than one slice's
keys and values and one tile's scores, however long the context.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from pyengine.executor.attention.metadata import PrefillChunk
from pyengine.executor.attention.sliced import DEFAULT_SLICE_ROWS, attend_in_slices, cached_rows
from pyengine.executor.attention.windowed import causal_mask
from pyengine.models.mla import LatentQueries

# Latent rows [L, latent_dim] -> keys [heads or 1, L, d] and values [heads or 1, L, v].
RowsToKeysValues = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def attend_expanded(
    chunk: PrefillChunk, queries: LatentQueries, latent: torch.Tensor, blocks: torch.Tensor, scale: float,
    slice_rows: int = DEFAULT_SLICE_ROWS,
) -> torch.Tensor:
    """[chunk tokens, heads, v]: the chunk attended over its expanded context; ``latent``
    is the step's rows, ``blocks`` the layer's cache (the chunk's rows written)."""
    q = queries.expanded(chunk.token_start, chunk.token_end)  # [heads, tokens, qk_head_dim]
    return _attend(chunk, q[:, None], queries.keys_values, queries.w_uv.shape[1], latent, blocks, scale, slice_rows)


def attend_absorbed(
    chunk: PrefillChunk, q: torch.Tensor, value_dim: int, latent: torch.Tensor, blocks: torch.Tensor, scale: float,
    slice_rows: int = DEFAULT_SLICE_ROWS,
) -> torch.Tensor:
    """``q`` [chunk tokens, heads, latent_dim] (absorbed) -> [chunk tokens, heads,
    value_dim]: the attention-weighted latents over the chunk's cached rows."""

    def shared(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rows[None], rows[None, :, :value_dim]

    return _attend(chunk, q.transpose(0, 1)[None], shared, value_dim, latent, blocks, scale, slice_rows)


def _attend(
    chunk: PrefillChunk, q: torch.Tensor, keys_values: RowsToKeysValues, value_dim: int, latent: torch.Tensor,
    blocks: torch.Tensor, scale: float, slice_rows: int,
) -> torch.Tensor:
    """``q`` [key heads, queries per key head, tokens, d] (``keys_values``' heads: 1
    absorbed, every head expanded) -> [tokens, heads, value_dim]."""
    tokens, seq_len = chunk.token_end - chunk.token_start, chunk.seq_len
    if seq_len > slice_rows:
        out = attend_in_slices(
            q, lambda start, end: keys_values(_context_rows(chunk, latent, blocks, start, end)),
            seq_len - tokens, seq_len, value_dim, scale, slice_rows,
        )
        return out.flatten(0, 1).transpose(0, 1)
    keys, values = keys_values(_context_rows(chunk, latent, blocks, 0, seq_len))
    fresh = chunk.block_ids is None
    mask = None if fresh else causal_mask(tokens, seq_len, q.device)
    out = F.scaled_dot_product_attention(
        q.flatten(0, 1)[None], keys[None], values[None], attn_mask=mask, is_causal=fresh, scale=scale,
        enable_gqa=q.shape[1] != 1,
    )
    return out[0].transpose(0, 1)


def _context_rows(chunk: PrefillChunk, latent: torch.Tensor, blocks: torch.Tensor, start: int,
                  end: int) -> torch.Tensor:
    """Latent rows ``start:end`` of the chunk's sequence: from the step's rows for a fresh
    prompt, else from the cache's blocks."""
    if chunk.block_ids is None:
        return latent[chunk.token_start + start : chunk.token_start + end]
    return cached_rows(blocks, chunk.block_ids, start, end)
