"""Paged attention with PyTorch's scaled_dot_product_attention (CPU and CUDA).

Per step the sequences split into two groups:

- single-query sequences (decodes, 1-token chunks): handled together, GQA folded into
  the query length (``[rows, kv_heads, group, head_dim]``) so no K/V is repeated, and a
  length mask only when the lengths differ.

  On CUDA their blocks are gathered into ``[rows, L, kv_heads, head_dim]`` and attended
  in one SDPA call. On CPU, where a gather's memory traffic would dominate, nothing is
  gathered: in float32 the native kernel ``pyengine._kernels.paged_decode_attention``
  (``rust_sched/kernels``) reads every key and value once, in place, on all intra-op
  threads; other dtypes gather keys in tiles that stay in the core's cache, use ``bmm``,
  and sum the values straight from the paged cache with ``embedding_bag``, weighted by
  the attention probabilities.
- a step of short chunks only (every sequence at most ``MAX_EXPANDED_QUERIES`` tokens,
  some more than one: a verification step's ``1 + d`` entries) goes, where the native
  kernel applies, as one decode row per token (``metadata.as_decode_rows``: a token at
  position ``p`` attends to its sequence's first ``p + 1`` positions, written before it
  attends), so such a step takes the model's native decode path too;
- multi-token sequences (prefill chunks): one SDPA call each, causal, with the chunk's
  earlier context read from the cache. There are few of them per step and each is large,
  so the Python loop costs little next to the work. A context longer than ``slice_rows``
  is not gathered whole: it is read and attended a slice at a time, the partial
  attentions merged by their log-sum-exps (``sliced.py``), so a chunk after a long
  cached context holds one slice's K / V and one tile's scores, not the whole context's.

Each layer passes its :class:`~pyengine.models.layers.LayerAttention`. A sliding window
reads only the window: the native decode kernel skips the blocks before it; the other
decode paths gather each row's table from the window's first block (a per-window group,
built once per step) and mask the few positions before the window's start; a prefill
chunk longer than the window goes in query tiles that each read only the keys they can
see (``windowed.py``). Soft-capped scores go through ``windowed.attend_masked``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from pyengine import _kernels
from pyengine.errors import InvalidConfigError
from pyengine.executor.attention.metadata import (
    PrefillChunk,
    StepAttentionLayout,
    as_decode_rows,
    prefill_chunks,
)
from pyengine.executor.attention.sliced import DEFAULT_SLICE_ROWS, attend_in_slices, cached_rows
from pyengine.executor.attention.windowed import attend_masked, causal_mask, windowed_chunk
from pyengine.executor.kv_cache import PagedKVCache
from pyengine.models.config import DecoderConfig
from pyengine.models.layers import FULL_ATTENTION, LayerAttention

# Gathered keys of one CPU tile should stay in the cores' caches (per intra-op thread).
CPU_TILE_BYTES = 2**20
# A step whose sequences have at most this many tokens each (a verification step of up
# to 7 drafts) is attended by the native decode kernel, a row per token; the kernel
# reads a sequence's K/V once for all its rows (``paged_decode.rs``, runs of rows), in
# place of the chunk path's gather, mask and SDPA call per sequence and layer.
MAX_EXPANDED_QUERIES = 8


@dataclass
class _SingleQueryGroup:
    token_indices: Optional[torch.Tensor]  # None: the group is every token of the step, in order
    block_ids: Optional[torch.Tensor]  # int64 [R * width] flattened block tables; None when native
    tables: torch.Tensor  # int32 [R, >= width] block tables of the group
    num_rows: int
    width: int  # blocks gathered per row
    kv_len: int  # longest context in the group
    mask: Optional[torch.Tensor]  # bool [R, 1, 1, kv_len], None when all lengths equal kv_len or native
    seq_lens: np.ndarray  # int32 [R] context length of each row
    tile_rows: int  # rows whose keys are gathered at once (CPU)
    use_value_bags: bool  # CPU path: keys in tiles + bmm, values through embedding_bag
    native: bool  # float32 on CPU: the native kernel, which needs neither block_ids nor mask
    window: Optional[int] = None  # the native kernel's window (the tables are not shifted for it)
    value_index: Optional[torch.Tensor] = None  # [R * heads * kv_len], built by the first layer
    bag_offsets: Optional[torch.Tensor] = None  # start of each (row, query head) bag


class SdpaBackend:
    """Attention backend built on ``torch.nn.functional.scaled_dot_product_attention``;
    ``slice_rows``: cached context rows a prefill chunk reads and attends at once."""

    name = "sdpa"

    def __init__(self, native_decode: bool = True, slice_rows: int = DEFAULT_SLICE_ROWS) -> None:
        # False: float32 CPU decode rows take the gathered path too (tests compare the two).
        self.native_decode = native_decode
        if slice_rows < 1:
            raise InvalidConfigError(f"slice_rows must be at least 1 row, got {slice_rows}")
        self.slice_rows = slice_rows

    def bind(self, cache: PagedKVCache, layout: StepAttentionLayout) -> "SdpaStepAttention":
        return SdpaStepAttention(cache, layout, self.native_decode, self.slice_rows)

    def profile_steps(self, tokens: int, max_model_len: int,
                      config: DecoderConfig) -> list[tuple[int, int, "SdpaBackend"]]:
        """(chunk tokens, cached rows before it, the backend to bind) of the step the memory
        profile runs besides a fresh prompt of ``tokens``: that chunk after one full slice
        of context, the most a chunk holds at once (a longer context is more slices, one at
        a time)."""
        context = max(0, min(self.slice_rows, max_model_len - tokens))
        return [(tokens, context, self)] if context else []


class SdpaStepAttention:
    """One step's attention: writes K/V to the cache, then attends per group."""

    def __init__(self, cache: PagedKVCache, layout: StepAttentionLayout, native_decode: bool = True,
                 slice_rows: int = DEFAULT_SLICE_ROWS) -> None:
        self.cache = cache
        if _expands_to_decode_rows(cache, layout, native_decode):
            layout = as_decode_rows(layout)
        self.layout = layout
        self.native_decode = native_decode
        self.slice_rows = slice_rows
        self.slot_mapping = layout.slot_mapping
        self.block_size = layout.block_size
        self.chunks = prefill_chunks(layout)
        single_rows = layout.num_scheduled_tokens == 1
        self.has_single = bool(single_rows.any())
        self.all_single = bool(single_rows.all())
        # The decode groups, by the window of the layers reading them (None: the whole
        # context), each built when a layer first reads it: a binding whose layers are all
        # windowed (a hybrid model's windowed table) never builds the full-context one.
        self.single_groups: dict[Optional[int], _SingleQueryGroup] = {}

    def attend(
        self,
        layer_index: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: LayerAttention = FULL_ATTENTION,
    ) -> torch.Tensor:
        key_slots, value_slots = self.cache.layer_slots(layer_index)
        key_slots.index_copy_(0, self.slot_mapping, k)
        value_slots.index_copy_(0, self.slot_mapping, v)
        key_blocks, value_blocks = self.cache.layer_blocks(layer_index)
        single = self._single_group(spec.window)
        if single is not None and single.token_indices is None:
            return self._attend_single(single, q, key_blocks, value_blocks, spec)
        out = torch.empty_like(q)
        if single is not None:
            out[single.token_indices] = self._attend_single(
                single, q[single.token_indices], key_blocks, value_blocks, spec
            )
        for chunk in self.chunks:
            out[chunk.token_start : chunk.token_end] = self._attend_chunk(
                chunk, q, k, v, key_blocks, value_blocks, spec
            )
        return out

    def fused_decode(self) -> Optional[NativeDecodeAttention]:
        """The step's attention for a model's native decode path, when every token of the
        step is a decode row the native kernel takes (float32 on CPU); else None."""
        if not self.all_single or not _native_decode_applies(self.cache, self.layout, self.native_decode):
            return None
        return NativeDecodeAttention(self)

    def decode_group(self, window: Optional[int]) -> _SingleQueryGroup:
        """The decode group of layers with ``window`` when every token is a decode row."""
        group = self._single_group(window)
        assert group is not None  # fused_decode() checked that the step has decode rows
        return group

    def _single_group(self, window: Optional[int]) -> Optional[_SingleQueryGroup]:
        """The decode group for layers with ``window`` (None: the whole context; a window
        no row's context exceeds is the whole context too), built on first use."""
        if not self.has_single:
            return None
        if window is not None and int(self.layout.seq_lens.max()) <= window:
            window = None
        group = self.single_groups.get(window)
        if group is None:
            group = _single_query_group(self.layout, self.cache, window, self.native_decode)
            assert group is not None  # the step has single-query rows
            self.single_groups[window] = group
        return group

    def _attend_single(
        self,
        group: _SingleQueryGroup,
        q: torch.Tensor,
        key_blocks: torch.Tensor,
        value_blocks: torch.Tensor,
        spec: LayerAttention,
    ) -> torch.Tensor:
        rows, heads, head_dim = q.shape
        kv_heads = key_blocks.shape[2]
        grouped_q = q.view(rows, kv_heads, heads // kv_heads, head_dim)
        if group.native:
            return _native_decode(group, q, key_blocks, value_blocks, spec)
        if not group.use_value_bags:
            assert group.block_ids is not None  # built for every group but the native one
            keys = _gather_rows(key_blocks, group.block_ids, rows, group.kv_len)
            values = _gather_rows(value_blocks, group.block_ids, rows, group.kv_len)
            if spec.softcap is None:
                out = F.scaled_dot_product_attention(
                    grouped_q, keys, values, attn_mask=group.mask, scale=spec.score_scale(head_dim)
                )
            else:  # [rows, kv_heads, group, kv_len] scores, capped, masked, softmax
                scores = torch.matmul(grouped_q, keys.transpose(2, 3)).float()
                scores.mul_(spec.score_scale(head_dim) / spec.softcap).tanh_().mul_(spec.softcap)
                if group.mask is not None:
                    scores.masked_fill_(~group.mask, float("-inf"))
                out = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)
            return out.reshape(rows, heads, head_dim)
        if group.value_index is None:  # same for every layer: built once per step
            group.value_index, group.bag_offsets = _value_bags(
                group.tables, group.width, group.kv_len, self.cache, heads
            )
        scores = self._tiled_scores(group, grouped_q, key_blocks)
        scores.mul_(spec.score_scale(head_dim))
        if spec.softcap is not None:
            scores.div_(spec.softcap).tanh_().mul_(spec.softcap)
        if group.mask is not None:
            scores.masked_fill_(~group.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        value_table = value_blocks.reshape(-1, head_dim)  # a view: [slots * kv_heads, head_dim]
        out = F.embedding_bag(
            group.value_index,
            value_table,
            group.bag_offsets,
            mode="sum",
            per_sample_weights=probs.reshape(-1),
        )
        return out.view(rows, heads, head_dim).to(q.dtype)

    def _tiled_scores(
        self, group: _SingleQueryGroup, grouped_q: torch.Tensor, key_blocks: torch.Tensor
    ) -> torch.Tensor:
        """q . k for every context position: ``[rows, kv_heads, group, kv_len]``."""
        rows, kv_heads, group_size, head_dim = grouped_q.shape
        block_ids = group.block_ids
        assert block_ids is not None  # built for every group but the native one
        scores = grouped_q.new_empty((rows, kv_heads, group_size, group.kv_len))
        buffer = key_blocks.new_empty((group.tile_rows * group.width,) + tuple(key_blocks.shape[1:]))
        for start in range(0, rows, group.tile_rows):
            end = min(start + group.tile_rows, rows)
            ids = block_ids[start * group.width : end * group.width]
            gathered = torch.index_select(key_blocks, 0, ids, out=buffer[: ids.numel()])
            keys = gathered.view(end - start, -1, kv_heads, head_dim)[:, : group.kv_len]
            for head in range(kv_heads):
                torch.bmm(
                    grouped_q[start:end, head], keys[:, :, head].transpose(1, 2), out=scores[start:end, head]
                )
        return scores

    def _attend_chunk(
        self,
        chunk: PrefillChunk,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_blocks: torch.Tensor,
        value_blocks: torch.Tensor,
        spec: LayerAttention,
    ) -> torch.Tensor:
        start, end = chunk.token_start, chunk.token_end
        query = q[start:end].transpose(0, 1)
        if spec.window is not None and chunk.seq_len > spec.window:
            out = windowed_chunk(query, key_blocks, value_blocks, chunk.table, chunk.seq_len, spec)
        elif chunk.block_ids is None:
            keys, values = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            out = attend_masked(query, keys, values, None, spec, causal=True)
        elif chunk.seq_len > self.slice_rows:
            out = self._attend_sliced(chunk, query, key_blocks, value_blocks, spec)
        else:
            keys = _gather_rows(key_blocks, chunk.block_ids, 1, chunk.seq_len)[0]
            values = _gather_rows(value_blocks, chunk.block_ids, 1, chunk.seq_len)[0]
            mask = causal_mask(end - start, chunk.seq_len, q.device)
            out = attend_masked(query, keys, values, mask, spec)
        return out.transpose(0, 1)

    def _attend_sliced(
        self, chunk: PrefillChunk, query: torch.Tensor, key_blocks: torch.Tensor, value_blocks: torch.Tensor,
        spec: LayerAttention,
    ) -> torch.Tensor:
        """``query`` [heads, tokens, d] over the cached context a slice at a time (GQA folded:
        ``[kv_heads, group, tokens, d]`` against ``[kv_heads, rows, d]``)."""
        heads, tokens, head_dim = query.shape
        kv_heads = key_blocks.shape[2]

        def keys_values(row_start: int, row_end: int) -> tuple[torch.Tensor, torch.Tensor]:
            keys = cached_rows(key_blocks, chunk.table, row_start, row_end)  # [rows, kv_heads, d]
            values = cached_rows(value_blocks, chunk.table, row_start, row_end)
            return keys.transpose(0, 1), values.transpose(0, 1)

        out = attend_in_slices(
            query.view(kv_heads, heads // kv_heads, tokens, head_dim), keys_values, chunk.seq_len - tokens,
            chunk.seq_len, value_blocks.shape[-1], spec.score_scale(head_dim), self.slice_rows, spec.softcap,
        )
        return out.view(heads, tokens, -1)


def _native_decode(
    group: _SingleQueryGroup,
    q: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    spec: LayerAttention,
) -> torch.Tensor:
    """float32 CPU decode attention by the native kernel: no gather, K and V read once (the
    window's positions only)."""
    return torch.from_numpy(
        _decode_kernel(group, q.contiguous().numpy(), key_blocks.numpy(), value_blocks.numpy(), spec)
    )


def _decode_kernel(
    group: _SingleQueryGroup, q: np.ndarray, key_blocks: np.ndarray, value_blocks: np.ndarray, spec: LayerAttention
) -> np.ndarray:
    """``_native_decode`` on arrays: q [rows, heads, head_dim] (C-contiguous) -> the same shape."""
    rows, heads, head_dim = q.shape
    out = np.empty((rows, heads, head_dim), dtype=np.float32)
    _kernels.paged_decode_attention(
        out,
        q,
        key_blocks,
        value_blocks,
        group.tables.numpy(),
        group.seq_lens,
        spec.score_scale(head_dim),
        torch.get_num_threads(),
        window=group.window or 0,
        softcap=spec.softcap or 0.0,
    )
    return out


class NativeDecodeAttention:
    """One step's attention for a model's native decode path (``pyengine.models.decode_path``):
    each layer hands over its fused q/k/v rows; their K and V go into the cache and the
    native kernel attends, with none of the per-layer tensor plumbing of ``attend``. Only
    built when every token of the step is a decode row the kernel takes
    (``SdpaStepAttention.fused_decode``)."""

    def __init__(self, step: "SdpaStepAttention") -> None:
        self.step = step
        self.slots = step.slot_mapping.numpy()
        cache = step.cache
        self.keys = cache.keys.numpy()  # [layers, blocks, block_size, kv_heads, head_dim]
        self.values = cache.values.numpy()
        self.head_dim = cache.shape.head_dim
        self.kv_width = cache.shape.num_kv_heads * cache.shape.head_dim

    def layer_inputs(self, layer_index: int, spec: LayerAttention) -> tuple:
        """What ``_kernels.DecodeLayer.run`` takes of this step for one layer: its key and value
        caches [blocks, block_size, kv_heads, head_dim], the rows' slots, block tables,
        context lengths and the window (0: none) as ``attend_fused`` would use them."""
        position = self.step.cache.layer_position(layer_index)
        group = self.step.decode_group(spec.window)
        return (self.keys[position], self.values[position], self.slots, group.tables.numpy(), group.seq_lens,
                group.window or 0)

    def attend_fused(self, layer_index: int, qkv: torch.Tensor, num_heads: int, spec: LayerAttention) -> torch.Tensor:
        """``qkv`` [rows, (num_heads + 2 kv_heads) * head_dim], q/k normed and rotated ->
        the attention output [rows, num_heads * head_dim]."""
        rows = qkv.shape[0]
        q_width, kv_width = num_heads * self.head_dim, self.kv_width
        fused = qkv.numpy()
        position = self.step.cache.layer_position(layer_index)
        keys, values = self.keys[position], self.values[position]
        keys.reshape(-1, kv_width)[self.slots] = fused[:, q_width : q_width + kv_width]
        values.reshape(-1, kv_width)[self.slots] = fused[:, q_width + kv_width :]
        query = np.ascontiguousarray(fused[:, :q_width]).reshape(rows, num_heads, self.head_dim)
        group = self.step.decode_group(spec.window)
        out = _decode_kernel(group, query, keys, values, spec)
        return torch.from_numpy(out.reshape(rows, q_width))


def _gather_rows(
    blocks: torch.Tensor, block_ids: torch.Tensor, rows: int, length: int, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Blocks of ``rows`` sequences -> ``[rows, kv_heads, length, head_dim]`` (a strided view)."""
    _, block_size, kv_heads, head_dim = blocks.shape
    gathered = (
        torch.index_select(blocks, 0, block_ids, out=out)
        if out is not None
        else blocks.index_select(0, block_ids)
    )
    return gathered.view(rows, -1, kv_heads, head_dim)[:, :length].transpose(1, 2)


def _tile_rows(width: int, cache: PagedKVCache) -> int:
    shape = cache.shape
    row_bytes = width * shape.block_size * shape.num_kv_heads * shape.head_dim * cache.keys.element_size()
    return max(1, CPU_TILE_BYTES * torch.get_num_threads() // row_bytes)


def _value_bags(
    tables: torch.Tensor, width: int, kv_len: int, cache: PagedKVCache, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Value-table rows (slot * kv_heads + kv_head) of each (row, query head, position) bag."""
    device = tables.device
    rows = tables.shape[0]
    block_size, kv_heads = cache.block_size, cache.shape.num_kv_heads
    positions = torch.arange(kv_len, device=device)
    slots = (
        tables[:, :width].to(torch.int64)[:, positions // block_size] * block_size + positions % block_size
    )
    kv_head_of_query_head = torch.arange(num_heads, device=device) // (num_heads // kv_heads)
    index = slots[:, None, :] * kv_heads + kv_head_of_query_head[None, :, None]
    offsets = torch.arange(0, rows * num_heads * kv_len, kv_len, device=device)
    return index.reshape(-1), offsets


def _single_query_group(
    layout: StepAttentionLayout, cache: PagedKVCache, window: Optional[int] = None, native_decode: bool = True
) -> Optional[_SingleQueryGroup]:
    single = np.flatnonzero(layout.num_scheduled_tokens == 1)
    if single.size == 0:
        return None
    device = layout.slot_mapping.device
    lengths = layout.seq_lens[single]
    everything = single.size == layout.num_scheduled_tokens.size
    row_index = None if everything else torch.from_numpy(single).to(device)
    tables = layout.block_tables if row_index is None else layout.block_tables.index_select(0, row_index)
    on_cpu = device.type == "cpu"
    native = _native_decode_applies(cache, layout, native_decode)
    window_starts = None
    if window is not None and not native:
        tables, lengths, window_starts = _from_window_block(tables, lengths, window, layout.block_size)
    kv_len = int(lengths.max())
    width = -(-kv_len // layout.block_size)
    if native:
        tables = tables.contiguous()  # read by the native kernel as one array, every layer
    block_ids = None if native else tables[:, :width].reshape(-1).to(torch.int64)
    mask = None
    if not native and (int(lengths.min()) != kv_len or window_starts is not None):
        lengths_t = torch.from_numpy(lengths.astype(np.int64)).to(device)
        positions = torch.arange(kv_len, device=device)[None, :]
        visible = positions < lengths_t[:, None]
        if window_starts is not None:
            visible &= positions >= torch.from_numpy(window_starts).to(device)[:, None]
        mask = visible.view(single.size, 1, 1, kv_len)
    token_indices = None
    if not everything:
        token_indices = torch.from_numpy(layout.query_start_loc[single].astype(np.int64)).to(device)
    tile_rows = _tile_rows(width, cache) if on_cpu else int(single.size)
    return _SingleQueryGroup(
        token_indices, block_ids, tables, int(single.size), width, kv_len, mask,
        np.ascontiguousarray(lengths, dtype=np.int32), tile_rows, on_cpu, native,
        window if native else None,
    )


def _expands_to_decode_rows(cache: PagedKVCache, layout: StepAttentionLayout, native_decode: bool) -> bool:
    """Whether a step whose sequences have up to ``MAX_EXPANDED_QUERIES`` tokens each, some
    more than one (a verification step's drafts, short chunks), goes to the native decode
    kernel as one row per token (``metadata.as_decode_rows``)."""
    counts = layout.num_scheduled_tokens
    if not len(counts) or not _native_decode_applies(cache, layout, native_decode):
        return False
    longest = int(counts.max())
    return 1 < longest <= MAX_EXPANDED_QUERIES


def _native_decode_applies(cache: PagedKVCache, layout: StepAttentionLayout, native_decode: bool) -> bool:
    """Whether decode rows go through the native kernel: float32 on the CPU."""
    return native_decode and layout.slot_mapping.device.type == "cpu" and cache.keys.dtype == torch.float32


def _from_window_block(
    tables: torch.Tensor, lengths: np.ndarray, window: int, block_size: int
) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """Each row's table shifted to start at the block holding its window's first position:
    the shifted tables, the lengths counted from there, and where (in the shifted
    positions) each window starts. Entries past a row's blocks repeat its last column
    (masked, never read as context)."""
    first_blocks = np.maximum(lengths.astype(np.int64) - window, 0) // block_size
    shifted_lengths = lengths - first_blocks * block_size
    width = -(-int(shifted_lengths.max()) // block_size)
    columns = torch.from_numpy(first_blocks).to(tables.device)[:, None] + torch.arange(width, device=tables.device)
    shifted = tables.gather(1, columns.clamp_(max=tables.shape[1] - 1))
    starts = np.maximum(lengths.astype(np.int64) - window, 0) - first_blocks * block_size
    return shifted, shifted_lengths, starts

