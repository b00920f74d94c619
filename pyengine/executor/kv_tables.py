"""Per-group block tables for hybrid models: which table and which cache tensor each layer
uses (``docs/executor.md``, KV sizing).

A hybrid model (Gemma 2/3, Qwen2 with ``max_window_layers``) mixes full-attention layers
with sliding-window ones. With per-group tables the scheduler splits the layers into
tables of at most ``layers_per_table`` layers (``SchedulerConfig.table_layout``, the one place the rule
lives) and keeps one block table per table and sequence, all drawing from one pool. The
cache then holds ``layers_per_table`` layers per block: cache tensor ``j`` is used by
layer ``j`` of whichever table owns the block, so a block a windowed table freed serves
a full table next. Each layer reads and writes through its own table's block table and
slot mapping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pyengine._sched import SchedulerConfig
from pyengine.models.layer_config import kv_groups as layer_kv_groups


@dataclass(frozen=True, slots=True)
class KVTables:
    """The layout of a hybrid model's per-group tables."""

    layers_per_table: int
    windows: tuple[Optional[int], ...]  # each table's window (None: full attention)
    table_of_layer: tuple[int, ...]  # the table each layer reads through
    cache_index_of_layer: tuple[int, ...]  # the cache tensor (0..layers_per_table) each layer uses

    @property
    def num_tables(self) -> int:
        return len(self.windows)


def plan_kv_tables(layer_windows: tuple[Optional[int], ...], num_layers: int) -> Optional[KVTables]:
    """The per-group tables the scheduler keeps for a model with these per-layer windows,
    or None when it keeps one shared table (not hybrid, or too many tables)."""
    groups = layer_kv_groups(layer_windows, num_layers)
    layout = SchedulerConfig(1, kv_groups=groups, group_tables=True).table_layout
    if layout is None:
        return None
    per, windows, owners = layout
    group_windows = [window for window, _ in groups]
    tables_of_group = [[t for t, owner in enumerate(owners) if owner == g] for g in range(len(groups))]
    seen = [0] * len(groups)
    table_of_layer, cache_index = [], []
    for layer in range(num_layers):
        group = group_windows.index(layer_windows[layer] if layer_windows else None)
        i = seen[group]
        seen[group] += 1
        table_of_layer.append(tables_of_group[group][i // per])
        cache_index.append(i % per)
    return KVTables(per, tuple(windows), tuple(table_of_layer), tuple(cache_index))
