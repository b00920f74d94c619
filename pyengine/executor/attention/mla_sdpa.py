"""Multi-head latent attention over the latent cache (DeepSeek-V2 / V3).

The model hands ``attend_mla`` its queries per head with the up-projections
(``models.mla.LatentQueries``); each sequence of the step is attended in one of two
forms, the same function:

- absorbed: each head's key up-projection folded into its query (``W_UK``), attention
  over the cached latent rows directly, one key "head" shared by every query head (MQA),
  the key being the whole row (``kv_lora_rank + qk_rope_head_dim``) and the value its
  first ``kv_lora_rank`` values; the value up-projection (``W_UV``) after. Nothing is
  expanded per context row. Single-query rows (decodes, 1-token chunks): in float32 on
  CPU the native kernel ``_kernels.paged_decode_attention`` (``rust_sched/kernels``)
  reads each row in place, given the same cache as keys and as values (the output's
  rotary columns are dropped); elsewhere the rows' blocks are gathered and attended in
  one SDPA call. Multi-token chunks: one SDPA call each over the chunk's context, causal.
- expanded, for a prompt chunk where it costs less (:func:`expands`: a long prefill,
  whose context is about as long as the chunk): the chunk's context rows are
  decompressed into per-head keys and values (``kv_b_proj``) and attended with
  ``qk_head_dim``-wide dot products instead of ``kv_lora_rank + qk_rope_head_dim``-wide
  ones, as DeepSeek's and vLLM's prefill do; at most ``expand_slice`` rows at once, the
  slices' partial attentions merged by their log-sum-exps (``mla_expanded``), so a chunk
  after a long cached context holds no more than after one slice of it.

``attend_latent`` is the absorbed form alone, for callers that absorbed their queries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from pyengine import _kernels
from pyengine.errors import InvalidConfigError
from pyengine.executor.attention.metadata import PrefillChunk, StepAttentionLayout, prefill_chunks
from pyengine.executor.attention.mla_expanded import DEFAULT_EXPAND_SLICE_ROWS, attend_expanded, visible_keys
from pyengine.executor.latent_kv_cache import LatentKVCache
from pyengine.models.mla import LatentQueries


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
    """Latent attention with the native decode kernel (CPU float32) and SDPA.
    ``expand_prefill`` False attends every chunk in the absorbed form (benches compare);
    ``expand_slice``: context rows an expanded chunk decompresses at once (``mla_expanded``)."""

    name = "mla_sdpa"

    def __init__(self, expand_prefill: bool = True, expand_slice: int = DEFAULT_EXPAND_SLICE_ROWS) -> None:
        if expand_slice < 1:
            raise InvalidConfigError(f"expand_slice must be at least 1 row, got {expand_slice}")
        self.expand_prefill = expand_prefill
        self.expand_slice = expand_slice

    def bind(self, cache: LatentKVCache, layout: StepAttentionLayout) -> "MlaStepAttention":
        return MlaStepAttention(cache, layout, expand_prefill=self.expand_prefill, expand_slice=self.expand_slice)

    def worst_case_context(self, tokens: int, max_model_len: int) -> int:
        """Cached rows before a chunk of ``tokens`` that make its step's temporaries the
        largest they get (one full slice expanded, every query in it): the memory profile
        runs that step besides a fresh prompt. 0: no sequence holds more than the chunk."""
        return max(0, min(self.expand_slice, max_model_len - tokens))


@dataclass(frozen=True)
class _Forms:
    """Which of a step's chunks are expanded, and the tokens left to the absorbed form."""

    expanded: list[PrefillChunk]
    absorbed: list[PrefillChunk]
    absorbed_tokens: Optional[torch.Tensor]  # int64; None when every token is in an expanded chunk


class MlaStepAttention:
    """One step's latent attention: writes the rows to the cache, then attends."""

    def __init__(self, cache: LatentKVCache, layout: StepAttentionLayout, native: Optional[bool] = None,
                 expand_prefill: bool = True, expand_slice: int = DEFAULT_EXPAND_SLICE_ROWS) -> None:
        """``native``: decode rows through the native kernel (default: float32 on CPU);
        ``expand_prefill``: chunks in the expanded form where it costs less, their context
        expanded ``expand_slice`` rows at a time."""
        self.cache = cache
        self.slot_mapping = layout.slot_mapping
        self.block_size = layout.block_size
        if native is None:
            native = layout.slot_mapping.device.type == "cpu" and cache.latents.dtype == torch.float32
        self.decodes = _decode_rows(layout, native)
        self.chunks = prefill_chunks(layout)
        self.num_tokens = layout.num_tokens
        self.expand_prefill = expand_prefill
        self.expand_slice = expand_slice
        self._forms: Optional[_Forms] = None  # decided at the first layer (the sizes are the model's)

    def attend_mla(self, layer_index: int, queries: LatentQueries, latent: torch.Tensor, scale: float) -> torch.Tensor:
        """``latent`` [T, latent_dim] (this step's rows) -> [T, heads, v]: each chunk in the
        form that costs less, the rest (decodes, short chunks) absorbed."""
        forms = self._forms_for(queries)
        if not forms.expanded:
            return queries.values(self.attend_latent(layer_index, queries.absorbed(), latent, scale))
        blocks = self._write(layer_index, latent)
        heads, v_dim = queries.w_uv.shape[0], queries.w_uv.shape[1]
        out = latent.new_empty(self.num_tokens, heads, v_dim)
        for chunk in forms.expanded:
            out[chunk.token_start : chunk.token_end] = attend_expanded(
                chunk, queries, latent, blocks, scale, self.expand_slice
            )
        tokens = forms.absorbed_tokens
        if tokens is not None:
            q = latent.new_zeros(self.num_tokens, heads, latent.shape[1])
            q[tokens] = queries.absorbed(tokens)
            weighted = q.new_empty(self.num_tokens, heads, self.cache.shape.value_dim)
            self._attend_absorbed(weighted, q, latent, blocks, scale, forms.absorbed)
            out[tokens] = queries.values(weighted[tokens])
        return out

    def attend_latent(
        self, layer_index: int, q: torch.Tensor, latent: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q ``[T, heads, latent_dim]`` (absorbed), latent ``[T, latent_dim]`` (this step's
        rows) -> ``[T, heads, value_dim]``, the attention-weighted latents."""
        blocks = self._write(layer_index, latent)
        decodes = self.decodes
        if decodes is not None and decodes.token_indices is None:
            return self._attend_decodes(decodes, q, blocks, scale)
        out = q.new_empty(q.shape[:2] + (self.cache.shape.value_dim,))
        self._attend_absorbed(out, q, latent, blocks, scale, self.chunks)
        return out

    def _write(self, layer_index: int, latent: torch.Tensor) -> torch.Tensor:
        self.cache.layer_slots(layer_index).index_copy_(0, self.slot_mapping, latent)
        return self.cache.layer_blocks(layer_index)

    def _attend_absorbed(self, out: torch.Tensor, q: torch.Tensor, latent: torch.Tensor, blocks: torch.Tensor,
                         scale: float, chunks: list[PrefillChunk]) -> None:
        """The decodes' and ``chunks``' rows of ``out``, from the absorbed queries ``q``."""
        decodes = self.decodes
        if decodes is not None:
            if decodes.token_indices is None:
                out[:] = self._attend_decodes(decodes, q, blocks, scale)
            else:
                out[decodes.token_indices] = self._attend_decodes(decodes, q[decodes.token_indices], blocks, scale)
        for chunk in chunks:
            out[chunk.token_start : chunk.token_end] = self._attend_chunk(chunk, q, latent, blocks, scale)

    def _forms_for(self, queries: LatentQueries) -> _Forms:
        if self._forms is None:
            expanded = [c for c in self.chunks if self.expand_prefill and expands(c, queries)]
            absorbed = [c for c in self.chunks if c not in expanded]
            tokens = None
            if self.decodes is not None or absorbed:
                keep = torch.ones(self.num_tokens, dtype=torch.bool)
                for chunk in expanded:
                    keep[chunk.token_start : chunk.token_end] = False
                tokens = keep.nonzero().squeeze(1).to(self.slot_mapping.device)
            self._forms = _Forms(expanded, absorbed, tokens)
        return self._forms

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
            mask, causal = visible_keys(chunk.seq_len - (end - start), end - start, 0, chunk.seq_len, q.device), False
        out = F.scaled_dot_product_attention(
            query, keys, keys[..., :value_dim], attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
        return out[0].transpose(0, 1)


def expands(chunk: PrefillChunk, queries: LatentQueries) -> bool:
    """Whether the expanded form costs fewer multiply-adds per head for ``chunk`` (``t``
    queries over ``n`` context rows) than the absorbed one:

    - absorbed: ``t nope r`` (queries into latent space) + ``t n (2 r + rope)`` (scores over
      the whole row, latents weighted) + ``t r v`` (values);
    - expanded: ``n (nope + v) r`` (keys and values of the context) + ``t n (nope + rope + v)``.

    With DeepSeek's sizes (nope 128, rope 64, v 128, r 512) a fresh prompt of any length
    expands, and a chunk after ``n`` cached rows expands from about 170 tokens on. Only
    multiply-adds: the memory is bounded apart, by expanding the context a slice at a time
    (``mla_expanded``), which leaves these counts as they are."""
    heads, nope, rank = queries.w_uk.shape
    v, rope = queries.w_uv.shape[1], queries.rope.shape[-1]
    t, n = chunk.token_end - chunk.token_start, chunk.seq_len
    absorbed = t * nope * rank + t * n * (2 * rank + rope) + t * rank * v
    expanded = n * (nope + v) * rank + t * n * (nope + rope + v)
    return expanded < absorbed


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
