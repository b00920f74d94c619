"""Multi-head latent attention over the latent cache (DeepSeek-V2 / V3), absorbed form.

The model folds each head's key up-projection into its query (``W_UK``) before calling
``attend_latent``, and its value up-projection into the output after (``W_UV``), as
DeepSeek and vLLM do at decode: attention then runs over the cached latent rows directly,
one key "head" shared by every query head (MQA), the key being the whole row
(``kv_lora_rank + qk_rope_head_dim``) and the value its first ``kv_lora_rank`` values.
Nothing is expanded per token, at decode or at prefill.

- single-query rows (decodes, 1-token chunks): in float32 on CPU the native kernel
  ``_kernels.paged_decode_attention`` (``rust_sched/kernels``) reads each row in place,
  given the same cache as keys and as values (the output's rotary columns are dropped);
  elsewhere the rows' blocks are gathered and attended in one SDPA call, the heads
  folded into the query length.
- multi-token chunks: one SDPA call each over the chunk's context, causal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from pyengine import _kernels
from pyengine.executor.attention.metadata import PrefillChunk, StepAttentionLayout, prefill_chunks
from pyengine.executor.latent_kv_cache import LatentKVCache


@dataclass
class _DecodeRows:
    token_indices: Optional[torch.Tensor]  # None: every token of the step, in order
    tables: torch.Tensor  # int32 [R, width]
    seq_lens: np.ndarray  # int32 [R]
    kv_len: int
    native: bool
    block_ids: Optional[torch.Tensor] = None  # int64 [R * width] (gather path)
    mask: Optional[torch.Tensor] = None  # bool [R, 1, 1, kv_len] (gather path, unequal lengths)


class MlaSdpaBackend:
    """Latent attention with the native decode kernel (CPU float32) and SDPA."""

    name = "mla_sdpa"

    def bind(self, cache: LatentKVCache, layout: StepAttentionLayout) -> "MlaStepAttention":
        return MlaStepAttention(cache, layout)


class MlaStepAttention:
    """One step's latent attention: writes the rows to the cache, then attends."""

    def __init__(self, cache: LatentKVCache, layout: StepAttentionLayout, native: Optional[bool] = None) -> None:
        """``native``: decode rows through the native kernel (default: float32 on CPU)."""
        self.cache = cache
        self.slot_mapping = layout.slot_mapping
        self.block_size = layout.block_size
        if native is None:
            native = layout.slot_mapping.device.type == "cpu" and cache.latents.dtype == torch.float32
        self.decodes = _decode_rows(layout, native)
        self.chunks = prefill_chunks(layout)

    def attend_latent(
        self, layer_index: int, q: torch.Tensor, latent: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q ``[T, heads, latent_dim]`` (absorbed), latent ``[T, latent_dim]`` (this step's
        rows) -> ``[T, heads, value_dim]``, the attention-weighted latents."""
        self.cache.layer_slots(layer_index).index_copy_(0, self.slot_mapping, latent)
        blocks = self.cache.layer_blocks(layer_index)
        value_dim = self.cache.shape.value_dim
        decodes = self.decodes
        if decodes is not None and decodes.token_indices is None:
            return self._attend_decodes(decodes, q, blocks, scale)
        out = q.new_empty(q.shape[:2] + (value_dim,))
        if decodes is not None:
            out[decodes.token_indices] = self._attend_decodes(decodes, q[decodes.token_indices], blocks, scale)
        for chunk in self.chunks:
            out[chunk.token_start : chunk.token_end] = self._attend_chunk(chunk, q, latent, blocks, scale)
        return out

    def _attend_decodes(self, rows: _DecodeRows, q: torch.Tensor, blocks: torch.Tensor, scale: float) -> torch.Tensor:
        value_dim = self.cache.shape.value_dim
        num_rows, heads, dim = q.shape
        if rows.native:
            out = torch.empty((num_rows, heads, dim), dtype=q.dtype)
            as_heads = blocks.unsqueeze(2).numpy()  # [blocks, block_size, 1 kv head, latent_dim]
            _kernels.paged_decode_attention(
                out.numpy(), q.contiguous().numpy(), as_heads, as_heads,
                rows.tables.numpy(), rows.seq_lens, scale, torch.get_num_threads(),
            )
            return out[..., :value_dim]
        assert rows.block_ids is not None  # built for every group but the native one
        keys = blocks.index_select(0, rows.block_ids).view(num_rows, -1, dim)[:, : rows.kv_len].unsqueeze(1)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(1), keys, keys[..., :value_dim], attn_mask=rows.mask, scale=scale
        )
        return out.squeeze(1)

    def _attend_chunk(
        self, chunk: PrefillChunk, q: torch.Tensor, latent: torch.Tensor, blocks: torch.Tensor, scale: float
    ) -> torch.Tensor:
        start, end = chunk.token_start, chunk.token_end
        value_dim = self.cache.shape.value_dim
        query = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, Tq, latent_dim]
        if chunk.block_ids is None:
            keys = latent[start:end][None, None]
            mask, causal = None, True
        else:
            context = blocks.index_select(0, chunk.block_ids).flatten(0, 1)[: chunk.seq_len]
            keys = context[None, None]
            mask, causal = _chunk_causal_mask(end - start, chunk.seq_len, q.device), False
        out = F.scaled_dot_product_attention(
            query, keys, keys[..., :value_dim], attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
        return out[0].transpose(0, 1)


def _chunk_causal_mask(query_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """Query i (at position seq_len - query_len + i) sees keys 0..that position."""
    query_positions = torch.arange(seq_len - query_len, seq_len, device=device)
    return torch.arange(seq_len, device=device)[None, :] <= query_positions[:, None]


def _decode_rows(layout: StepAttentionLayout, native: bool) -> Optional[_DecodeRows]:
    single = np.flatnonzero(layout.num_scheduled_tokens == 1)
    if single.size == 0:
        return None
    device = layout.slot_mapping.device
    lengths = np.ascontiguousarray(layout.seq_lens[single], dtype=np.int32)
    kv_len = int(lengths.max())
    width = -(-kv_len // layout.block_size)
    everything = single.size == layout.num_scheduled_tokens.size
    tables = layout.block_tables if everything else layout.block_tables.index_select(
        0, torch.from_numpy(single).to(device)
    )
    token_indices = None if everything else torch.from_numpy(layout.query_start_loc[single].astype(np.int64)).to(device)
    rows = _DecodeRows(token_indices, tables.contiguous(), lengths, kv_len, native)
    if not native:
        rows.block_ids = tables[:, :width].reshape(-1).to(torch.int64)
        if int(lengths.min()) != kv_len:
            lengths_t = torch.from_numpy(lengths.astype(np.int64)).to(device)
            rows.mask = (torch.arange(kv_len, device=device)[None, :] < lengths_t[:, None]).view(
                single.size, 1, 1, kv_len
            )
    return rows
