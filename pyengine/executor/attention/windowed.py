"""Attention that SDPA alone does not cover: sliding windows and soft-capped scores.

A windowed layer (``LayerAttention.window = W``) lets query ``i`` see keys ``i - W < j <= i``.
Computing that as a mask over the whole context is correct but reads and scores every
cached position; here a prefill chunk is cut into query tiles and each tile reads only
the keys its window can reach (``tile + W - 1`` positions), so a chunk's work grows with
``tokens x W``, not ``tokens x context``. Soft-capped scores (Gemma 2:
``cap * tanh(score / cap)`` before the softmax) have no SDPA flag, so they are computed
here explicitly, also in query tiles to bound the ``[heads, tile, keys]`` scores.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pyengine.models.layers import LayerAttention

# Query rows per tile of an explicit (soft-capped) attention: bounds its score matrix.
SCORE_TILE_QUERIES = 512
# Fewest query rows per windowed tile (a tiny window would otherwise mean many tiny calls).
MIN_WINDOW_TILE = 256


def attend_masked(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: Optional[torch.Tensor],
    spec: LayerAttention,
    *,
    causal: bool = False,
) -> torch.Tensor:
    """``query`` [heads, Tq, d] over ``keys`` / ``values`` [kv_heads, Tk, d] (GQA folded, no
    repeat); ``mask`` [Tq, Tk] bool (True: visible) or None; ``causal`` (only with no
    mask, Tq == Tk) is SDPA's ``is_causal``. Returns [heads, Tq, d]."""
    scale = spec.score_scale(query.shape[-1])
    if spec.softcap is None:
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, is_causal=causal and mask is None, scale=scale, enable_gqa=True
        )
    if causal and mask is None:
        mask = causal_mask(query.shape[1], keys.shape[1], query.device)
    heads, tokens, head_dim = query.shape
    kv_heads = keys.shape[0]
    grouped = query.view(kv_heads, heads // kv_heads, tokens, head_dim)
    out = torch.empty_like(grouped)
    for start in range(0, tokens, SCORE_TILE_QUERIES):
        end = min(start + SCORE_TILE_QUERIES, tokens)
        scores = torch.matmul(grouped[:, :, start:end], keys.transpose(1, 2)[:, None]).float()
        scores.mul_(scale / spec.softcap).tanh_().mul_(spec.softcap)
        if mask is not None:
            scores.masked_fill_(~mask[start:end], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out[:, :, start:end] = torch.matmul(probs, values[:, None])
    return out.view(heads, tokens, head_dim)


def causal_mask(query_len: int, key_len: int, device: torch.device, window: Optional[int] = None) -> torch.Tensor:
    """[query_len, key_len] visibility when the queries are the last ``query_len`` of the
    ``key_len`` positions: causal, and within ``window`` positions when given."""
    return window_mask(key_len - query_len, query_len, 0, key_len, device, window)


def window_mask(
    query_start: int, query_len: int, key_start: int, key_len: int, device: torch.device, window: Optional[int]
) -> torch.Tensor:
    """Visibility of keys at positions ``key_start..+key_len`` to queries at
    ``query_start..+query_len``: ``j <= i`` and, with a window, ``j > i - window``."""
    query_positions = torch.arange(query_start, query_start + query_len, device=device)[:, None]
    key_positions = torch.arange(key_start, key_start + key_len, device=device)[None, :]
    visible = key_positions <= query_positions
    if window is not None:
        visible &= key_positions > query_positions - window
    return visible


def windowed_chunk(
    query: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    table: torch.Tensor,
    seq_len: int,
    spec: LayerAttention,
) -> torch.Tensor:
    """A prefill chunk of one sequence under a sliding window, from the paged cache (this
    step's K/V already written there): ``query`` [heads, n, d] are positions
    ``seq_len - n .. seq_len``; ``table`` the sequence's block ids (int64). Each tile of
    queries reads only the blocks holding the keys its window reaches."""
    window = spec.window
    assert window is not None  # callers pass windowed layers only
    heads, tokens, head_dim = query.shape
    block_size = key_blocks.shape[1]
    first_query = seq_len - tokens
    tile = max(window, MIN_WINDOW_TILE)
    out = torch.empty_like(query)
    for start in range(0, tokens, tile):
        end = min(start + tile, tokens)
        query_lo, query_hi = first_query + start, first_query + end
        key_lo = max(0, query_lo - window + 1)
        block_lo, block_hi = key_lo // block_size, -(-query_hi // block_size)
        ids = table[block_lo:block_hi]
        offset = key_lo - block_lo * block_size
        keys = _gathered(key_blocks, ids, offset, query_hi - key_lo)
        values = _gathered(value_blocks, ids, offset, query_hi - key_lo)
        mask = window_mask(query_lo, end - start, key_lo, query_hi - key_lo, query.device, window)
        out[:, start:end] = attend_masked(query[:, start:end], keys, values, mask, spec)
    return out


def _gathered(blocks: torch.Tensor, ids: torch.Tensor, offset: int, length: int) -> torch.Tensor:
    """Positions ``offset..offset+length`` of the blocks ``ids``: [kv_heads, length, d]."""
    _, _, kv_heads, head_dim = blocks.shape
    return blocks.index_select(0, ids).view(-1, kv_heads, head_dim)[offset : offset + length].transpose(0, 1)
