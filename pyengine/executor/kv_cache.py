"""The paged KV cache: two tensors per model, allocated once, and how many blocks fit.

Layout (what both attention backends want): keys and values are each
``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``; a token's slot is
``block_id * block_size + position % block_size`` (``slot_mapping`` in the plan), so a
layer's cache viewed as ``[num_blocks * block_size, num_kv_heads, head_dim]`` is indexed
by slot directly.

A hybrid model with per-group block tables (``kv_tables.py``) holds ``layers_per_table``
layers per block instead of every layer: ``num_layers`` is then that count, and the
tables' ``cache_index_of_layer`` says which cache tensor each model layer uses (layer
``j`` of each table shares tensor ``j``; the block ids keep the tables apart). A draft
model's cache over those tables is laid out the same way (``kv_tables.proposer_tables``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from pyengine.errors import KVCacheTooSmallError

if TYPE_CHECKING:
    from pyengine.executor.kv_tables import KVTables


@dataclass(frozen=True, slots=True)
class KVCacheShape:
    """Per-block geometry of the cache for one model (this tensor-parallel rank's heads)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """Keys + values of one block across all layers."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element


def blocks_for_budget(shape: KVCacheShape, budget_bytes: int, most_useful: int) -> int:
    """Blocks that fit in ``budget_bytes``, capped at ``most_useful`` (more could never be used)."""
    blocks = budget_bytes // shape.bytes_per_block
    if blocks < 1:
        raise KVCacheTooSmallError(
            f"KV cache budget of {budget_bytes} bytes holds no block (one block needs {shape.bytes_per_block} bytes)"
        )
    return int(min(blocks, most_useful))


class PagedKVCache:
    """Key and value tensors for every layer, zero-initialised (masked reads stay finite)."""

    def __init__(
        self, shape: KVCacheShape, num_blocks: int, device: torch.device, tables: Optional["KVTables"] = None,
    ) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        # Model layer -> cache tensor: per-group tables' (None: the same index).
        self.layer_index_map = None if tables is None else tables.cache_index_of_layer
        if tables is not None and shape.num_layers != tables.layers_per_table:
            raise ValueError(f"a cache over per-group tables holds {tables.layers_per_table} layers per block, "
                             f"not {shape.num_layers}")
        dims = (shape.num_layers, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
        self.keys = torch.zeros(dims, dtype=shape.dtype, device=device)
        self.values = torch.zeros(dims, dtype=shape.dtype, device=device)

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.shape.bytes_per_block

    def layer_position(self, layer_index: int) -> int:
        """The cache tensor (first dimension of ``keys`` / ``values``) a model layer uses."""
        index_map = self.layer_index_map
        return layer_index if index_map is None else index_map[layer_index]

    def layer_blocks(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one layer, ``[num_blocks, block_size, kv_heads, head_dim]``."""
        position = self.layer_position(layer_index)
        return self.keys[position], self.values[position]

    def layer_slots(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one layer viewed by slot, ``[num_slots, kv_heads, head_dim]``."""
        keys, values = self.layer_blocks(layer_index)
        return keys.flatten(0, 1), values.flatten(0, 1)
