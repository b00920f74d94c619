"""Paged attention with flash-attn's varlen kernel (CUDA only).

One ``flash_attn_varlen_func`` call per layer covers the whole step (prefill chunks and
decodes together; ``causal=True`` aligns each query chunk to the end of its context).
Upstream flash-attn 2 (>= 2.5) reads a paged cache directly through ``block_table`` only
when the block size is a multiple of 256; for smaller blocks (or older versions without
``block_table``) the step's context is gathered into a packed
``[sum(seq_lens), kv_heads, head_dim]`` tensor first (indices computed once per step, one
``index_select`` per layer).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import numpy as np
import torch

from pyengine.executor.attention.metadata import StepAttentionLayout
from pyengine.executor.kv_cache import PagedKVCache
from pyengine.models.layers import FULL_ATTENTION, LayerAttention

#: Block sizes upstream flash-attn reads in place through a block table are multiples of
#: this (so it is the default block size where flash-attn runs: ``selector.default_block_size``).
FLASH_PAGED_BLOCK_MULTIPLE = 256


def import_flash_varlen() -> Optional[Callable[..., Any]]:
    """``flash_attn.flash_attn_varlen_func`` when flash-attn is installed and imports, else
    None."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:  # not installed, or broken (an undefined symbol is an ImportError)
        return None
    return flash_attn_varlen_func


class FlashAttentionBackend:
    """Attention backend built on ``flash_attn.flash_attn_varlen_func``."""

    name = "flash_attn"

    def __init__(self, varlen_func: Callable[..., Any]) -> None:
        self.varlen_func = varlen_func
        self.supports_block_table = _accepts_block_table(varlen_func)

    def bind(self, cache: PagedKVCache, layout: StepAttentionLayout) -> "FlashStepAttention":
        paged = self.supports_block_table and layout.block_size % FLASH_PAGED_BLOCK_MULTIPLE == 0
        return FlashStepAttention(self.varlen_func, cache, layout, paged)


def _accepts_block_table(func: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False
    return "block_table" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


class FlashStepAttention:
    """One step's attention through flash-attn."""

    def __init__(
        self, varlen_func: Callable[..., Any], cache: PagedKVCache, layout: StepAttentionLayout, paged: bool
    ) -> None:
        device = layout.slot_mapping.device
        self.varlen_func = varlen_func
        self.cache = cache
        self.slot_mapping = layout.slot_mapping
        seq_lens = layout.seq_lens.astype(np.int64)
        self.cu_seqlens_q = torch.from_numpy(layout.query_start_loc.astype(np.int32)).to(device)
        self.cu_seqlens_k = torch.from_numpy(np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int32)).to(
            device
        )
        self.max_seqlen_q = int(layout.num_scheduled_tokens.max())
        self.max_seqlen_k = int(seq_lens.max())
        self.paged = paged
        self.block_table = layout.block_tables.to(torch.int32).contiguous() if self.paged else None
        self.context_slots = None if self.paged else _context_slots(layout, seq_lens, device)

    def fused_decode(self) -> None:
        """No native decode path on CUDA: the model runs its modules."""
        return None

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
        extra = _layer_arguments(spec)
        if self.paged:
            keys, values = self.cache.layer_blocks(layer_index)
            extra["block_table"] = self.block_table
        else:
            keys = key_slots.index_select(0, self.context_slots)
            values = value_slots.index_select(0, self.context_slots)
        return self.varlen_func(
            q,
            keys,
            values,
            cu_seqlens_q=self.cu_seqlens_q,
            cu_seqlens_k=self.cu_seqlens_k,
            max_seqlen_q=self.max_seqlen_q,
            max_seqlen_k=self.max_seqlen_k,
            causal=True,
            **extra,
        )


def _layer_arguments(spec: LayerAttention) -> dict[str, Any]:
    """flash-attn's arguments for a layer's scale, window and soft-cap (only those set, so
    a plain layer calls it as before): its ``window_size=(left, 0)`` counts the keys
    before the query, one less than the window."""
    extra: dict[str, Any] = {}
    if spec.scale is not None:
        extra["softmax_scale"] = spec.scale
    if spec.window is not None:
        extra["window_size"] = (spec.window - 1, 0)
    if spec.softcap is not None:
        extra["softcap"] = spec.softcap
    return extra


def _context_slots(layout: StepAttentionLayout, seq_lens: np.ndarray, device: torch.device) -> torch.Tensor:
    """Slot of every context token of every scheduled sequence, packed row after row."""
    rows = torch.arange(seq_lens.size, device=device).repeat_interleave(torch.from_numpy(seq_lens).to(device))
    starts = torch.from_numpy(np.concatenate([[0], np.cumsum(seq_lens)[:-1]])).to(device)
    positions = torch.arange(rows.numel(), device=device) - starts[rows]
    block_ids = layout.block_tables.to(torch.int64)[rows, positions // layout.block_size]
    return block_ids * layout.block_size + positions % layout.block_size
