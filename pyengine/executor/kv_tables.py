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

The layout depends on the target model's layers only, so every tensor-parallel rank (a
worker knows nothing of the speculative config) lays its cache out the same way. A draft
model's layers read the target's tables (``proposer_tables``: a windowed layer one of its
window's tables, every other a full one; an EAGLE-3 head's one layer table 0) and lay the
draft's own cache out the same way; they add no table of their own
(``docs/speculative_decoding.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pyengine._sched import SchedulerConfig
from pyengine.models.config import DecoderConfig
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


def model_kv_tables(model_config: DecoderConfig) -> Optional[KVTables]:
    """A model's per-group tables (``plan_kv_tables``); None for latent attention (MLA
    models have no windows: one table)."""
    if model_config.mla is not None:
        return None
    return plan_kv_tables(model_config.layer_windows, model_config.num_hidden_layers)


def proposer_tables(target: KVTables, layer_windows: tuple[Optional[int], ...], num_layers: int) -> KVTables:
    """Which of the target's tables each layer of a proposer (a draft model) reads, and the
    tensor of the proposer's own cache it uses there: a layer with a window some target
    table has reads one of those tables, every other layer (full attention, or a window no
    target table has) a full table, which holds every block it may read. Each layer goes
    to the eligible table with the fewest so far, so the proposer's cache holds as few
    layers per block as it can (``layers_per_table``), as the target's does."""
    counts = [0] * target.num_tables
    table_of_layer, cache_index = [], []
    for layer in range(num_layers):
        window = layer_windows[layer] if layer_windows else None
        eligible = [t for t, w in enumerate(target.windows) if w == window and window is not None]
        if not eligible:
            eligible = [t for t, w in enumerate(target.windows) if w is None]
        table = min(eligible, key=lambda t: (counts[t], t))
        table_of_layer.append(table)
        cache_index.append(counts[table])
        counts[table] += 1
    return KVTables(max(counts), target.windows, tuple(table_of_layer), tuple(cache_index))
