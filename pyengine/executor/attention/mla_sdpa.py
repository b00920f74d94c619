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
  one SDPA call. Multi-token chunks: each over the chunk's context, causal
  (``mla_chunk.attend_absorbed``).
- expanded, for a prompt chunk where it costs less (:func:`expands`: a long prefill,
  whose context is about as long as the chunk): the chunk's context rows are
  decompressed into per-head keys and values (``kv_b_proj``) and attended with
  ``qk_head_dim``-wide dot products instead of ``kv_lora_rank + qk_rope_head_dim``-wide
  ones, as DeepSeek's and vLLM's prefill do (``mla_chunk.attend_expanded``).

A chunk in either form attends at most ``slice_rows`` context rows at once, the slices'
partial attentions merged by their log-sum-exps (``sliced.py``), so a chunk after a long
cached context holds no more than after one slice of it.

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
from pyengine.executor.attention.mla_chunk import attend_absorbed, attend_expanded
from pyengine.executor.attention.sliced import DEFAULT_SLICE_ROWS
from pyengine.executor.latent_kv_cache import LatentKVCache
from pyengine.models.config import DecoderConfig
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
    ``slice_rows``: context rows a chunk attends at once, in either form (``sliced.py``)."""

    name = "mla_sdpa"

    def __init__(self, expand_prefill: bool = True, slice_rows: int = DEFAULT_SLICE_ROWS) -> None:
        if slice_rows < 1:
            raise InvalidConfigError(f"slice_rows must be at least 1 row, got {slice_rows}")
        self.expand_prefill = expand_prefill
        self.slice_rows = slice_rows

    def bind(self, cache: LatentKVCache, layout: StepAttentionLayout) -> "MlaStepAttention":
        return MlaStepAttention(cache, layout, expand_prefill=self.expand_prefill, slice_rows=self.slice_rows)

    def profile_steps(self, tokens: int, max_model_len: int,
                      config: DecoderConfig) -> list[tuple[int, int, "MlaSdpaBackend"]]:
        """(chunk tokens, cached rows before it, the backend to bind) of the steps whose
        temporaries are each form's largest, which the memory profile runs besides a fresh
        prompt of ``tokens``. A chunk holds the most from one full slice of context on (a
        longer context is more slices, one at a time, of the same size): a chunk of
        ``tokens`` after a slice, in whichever form it takes there, and, when that is the
        expanded one, the longest chunk that stays absorbed after any context that fits
        (170 tokens with DeepSeek's sizes, a long context's), attended absorbed after a
        slice. Empty: no context fits before a chunk."""
        mla = config.mla
        assert mla is not None  # latent attention is bound for MLA models only
        sizes = (mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim, mla.kv_lora_rank)

        def context(chunk: int) -> int:
            return max(0, min(self.slice_rows, max_model_len - chunk))

        if not context(tokens):
            return []
        steps = [(tokens, context(tokens), self)]
        if self.expand_prefill and expansion_costs_less(tokens, tokens + context(tokens), *sizes):
            # the longer the context, the longer a chunk that stays absorbed: the longest at max_model_len
            absorbed = next((t for t in range(tokens, 1, -1) if not expansion_costs_less(t, max_model_len, *sizes)), None)
            if absorbed is not None:
                forced = type(self)(expand_prefill=False, slice_rows=self.slice_rows)
                steps.append((absorbed, context(absorbed), forced))
        return steps


@dataclass(frozen=True)
class _Forms:
    """Which of a step's chunks are expanded, and the tokens left to the absorbed form."""

    expanded: list[PrefillChunk]
    absorbed: list[PrefillChunk]
    absorbed_tokens: Optional[torch.Tensor]  # int64; None when every token is in an expanded chunk


class MlaStepAttention:
    """One step's latent attention: writes the rows to the cache, then attends."""

    def __init__(self, cache: LatentKVCache, layout: StepAttentionLayout, native: Optional[bool] = None,
                 expand_prefill: bool = True, slice_rows: int = DEFAULT_SLICE_ROWS) -> None:
        """``native``: decode rows through the native kernel (default: float32 on CPU);
        ``expand_prefill``: chunks in the expanded form where it costs less; either form
        attends ``slice_rows`` context rows at a time."""
        self.cache = cache
        self.slot_mapping = layout.slot_mapping
        self.block_size = layout.block_size
        if native is None:
            native = layout.slot_mapping.device.type == "cpu" and cache.latents.dtype == torch.float32
        self.decodes = _decode_rows(layout, native)
        self.chunks = prefill_chunks(layout)
        self.num_tokens = layout.num_tokens
        self.expand_prefill = expand_prefill
        self.slice_rows = slice_rows
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
                chunk, queries, latent, blocks, scale, self.slice_rows
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
        """The decodes' and ``chunks``' rows of ``out``, from the absorbed queries ``q``;
        the step has chunks (a step of decodes alone is ``attend_latent``'s)."""
        decodes = self.decodes
        if decodes is not None:
            assert decodes.token_indices is not None  # not every token: there are chunks
            out[decodes.token_indices] = self._attend_decodes(decodes, q[decodes.token_indices], blocks, scale)
        value_dim = self.cache.shape.value_dim
        for chunk in chunks:
            start, end = chunk.token_start, chunk.token_end
            out[start:end] = attend_absorbed(chunk, q[start:end], value_dim, latent, blocks, scale, self.slice_rows)

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


def expands(chunk: PrefillChunk, queries: LatentQueries) -> bool:
    """Whether the expanded form costs fewer multiply-adds per head for ``chunk`` (``t``
    queries over ``n`` context rows) than the absorbed one:

    - absorbed: ``t nope r`` (queries into latent space) + ``t n (2 r + rope)`` (scores over
      the whole row, latents weighted) + ``t r v`` (values);
    - expanded: ``n (nope + v) r`` (keys and values of the context) + ``t n (nope + rope + v)``.

    With DeepSeek's sizes (nope 128, rope 64, v 128, r 512) a fresh prompt of any length
    expands, and a chunk after ``n`` cached rows expands from about 170 tokens on. Only
    multiply-adds: the memory is bounded apart, by attending the context a slice at a time
    (``sliced.py``), which leaves these counts as they are."""
    _, nope, rank = queries.w_uk.shape
    return expansion_costs_less(
        chunk.token_end - chunk.token_start, chunk.seq_len, nope, queries.rope.shape[-1], queries.w_uv.shape[1], rank
    )


def expansion_costs_less(t: int, n: int, nope: int, rope: int, v: int, rank: int) -> bool:
    """:func:`expands` for ``t`` queries over ``n`` rows, from the head sizes."""
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
