"""The paged cache of multi-head latent attention (DeepSeek-V2 / V3): one latent per token.

MLA's keys and values are both expanded from a ``kv_lora_rank`` latent per token (plus a
``qk_rope_head_dim`` rotary key shared by every head), so the cache holds that row and
nothing else: ``[num_layers, num_blocks, block_size, latent_dim]``, one tensor, indexed
by slot like ``PagedKVCache``. A block costs ``latent_dim`` values per token and layer
instead of ``2 * kv_heads * head_dim``, and the same memory budget gives that many times
more blocks (``blocks_for_budget`` reads ``bytes_per_block``, whichever cache it is).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LatentKVCacheShape:
    """Per-block geometry of a latent cache (identical on every tensor-parallel rank: the
    latent is not split by heads)."""

    num_layers: int
    latent_dim: int  # kv_lora_rank + qk_rope_head_dim
    value_dim: int  # kv_lora_rank: the part of a row that is the value
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """One latent row per token and layer."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.block_size * self.latent_dim * element


class LatentKVCache:
    """The latent rows of every layer, zero-initialised (masked reads stay finite)."""

    def __init__(self, shape: LatentKVCacheShape, num_blocks: int, device: torch.device) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        dims = (shape.num_layers, num_blocks, shape.block_size, shape.latent_dim)
        self.latents = torch.zeros(dims, dtype=shape.dtype, device=device)

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.shape.bytes_per_block

    def layer_blocks(self, layer_index: int) -> torch.Tensor:
        """One layer's rows, ``[num_blocks, block_size, latent_dim]``."""
        return self.latents[layer_index]

    def layer_slots(self, layer_index: int) -> torch.Tensor:
        """One layer's rows by slot, ``[num_slots, latent_dim]``."""
        return self.latents[layer_index].flatten(0, 1)
