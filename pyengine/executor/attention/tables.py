"""Attention for a hybrid model with per-group block tables (``executor/kv_tables.py``):
each layer attends through its own table's block tables and slot mapping.

The step's layout carries table 0's arrays and, in ``group_layouts``, those of the other
tables; :class:`TableAttentionBackend` binds the wrapped backend once per table (the
same cache, whose ``layer_index_map`` says which tensor each layer uses) and hands each
layer's call to its table's binding. The backends themselves are unchanged: a windowed
table's entries behind the window are never written, and its layers never read them
(the windowed paths start at the window's first block, as under a shared window).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pyengine.executor.attention.metadata import StepAttentionLayout
from pyengine.executor.kv_cache import PagedKVCache
from pyengine.models.layers import FULL_ATTENTION, LayerAttention


class TableAttentionBackend:
    """Wraps a backend: one binding per table, each layer sent to its table's."""

    def __init__(self, inner: Any, table_of_layer: tuple[int, ...]) -> None:
        self.inner = inner
        self.name = inner.name
        self.table_of_layer = table_of_layer

    def profile_steps(self, tokens: int, max_model_len: int, config: Any) -> list[tuple[int, int, Any]]:
        """The wrapped backend's extra memory-profile steps (the profiling forward runs on
        one table, which ``bind`` hands to the wrapped backend whole)."""
        steps = getattr(self.inner, "profile_steps", None)
        return [] if steps is None else steps(tokens, max_model_len, config)

    def bind(self, cache: PagedKVCache, layout: StepAttentionLayout) -> Any:
        if not layout.group_layouts:  # a layout with one table (the profiling forward)
            return self.inner.bind(cache, layout)
        ops = [self.inner.bind(cache, table) for table in (layout, *layout.group_layouts)]
        return TableStepAttention(ops, self.table_of_layer)


class TableStepAttention:
    """One step's attention over per-group tables."""

    def __init__(self, ops: list[Any], table_of_layer: tuple[int, ...]) -> None:
        self.ops = ops
        self.table_of_layer = table_of_layer

    def attend(
        self,
        layer_index: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: LayerAttention = FULL_ATTENTION,
    ) -> torch.Tensor:
        return self.ops[self.table_of_layer[layer_index]].attend(layer_index, q, k, v, spec)

    def fused_decode(self) -> Optional["TableFusedDecode"]:
        """The native decode path when every table's binding offers it."""
        fused = [getattr(op, "fused_decode", lambda: None)() for op in self.ops]
        if any(f is None for f in fused):
            return None
        return TableFusedDecode(fused, self.table_of_layer)


class TableFusedDecode:
    """``attend_fused`` and ``layer_inputs`` through each layer's table."""

    def __init__(self, fused: list[Any], table_of_layer: tuple[int, ...]) -> None:
        self.fused = fused
        self.table_of_layer = table_of_layer

    def attend_fused(self, layer_index: int, qkv: torch.Tensor, num_heads: int, spec: LayerAttention) -> torch.Tensor:
        return self.fused[self.table_of_layer[layer_index]].attend_fused(layer_index, qkv, num_heads, spec)

    def layer_inputs(self, layer_index: int, spec: LayerAttention) -> tuple:
        return self.fused[self.table_of_layer[layer_index]].layer_inputs(layer_index, spec)
