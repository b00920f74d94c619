"""Rotary position embeddings (rotate-half / NeoX layout) with Llama-3, linear, YaRN
(``rope_yarn``) and Phi-3's longrope scaling.

Longrope has two sets of frequencies: the short ones for sequences up to
``original_max_position_embeddings`` and the long ones past it. transformers picks one per
forward call by its longest sequence (``max(position_ids) + 1``) and, in ``generate``,
recomputes the whole cache once a sequence crosses that length. Here the choice is per
token, by its own sequence's length at this step (``context_lens``): a prompt prefilled in
one step, and every token after the crossing, get what transformers gives them; keys
cached before the crossing keep their short rotation (vLLM's behaviour), as a paged cache
is not recomputed.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from pyengine.models.config import RopeConfig
from pyengine.models.rope_yarn import yarn_attention_factor, yarn_inverse_frequencies


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2] in float32, scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "longrope":
        return inv_freq / torch.tensor(rope.short_factor, dtype=torch.float32)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    if rope.rope_type == "yarn":
        return yarn_inverse_frequencies(rope, head_dim)
    return inv_freq


def rope_attention_factor(rope: RopeConfig) -> float:
    """What the cos / sin tables are multiplied by (YaRN's magnitude correction, longrope's
    attention factor; else 1)."""
    if rope.rope_type == "longrope":
        return float(rope.attention_factor or 1.0)
    return yarn_attention_factor(rope) if rope.rope_type == "yarn" else 1.0


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _long_inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (torch.tensor(rope.long_factor, dtype=torch.float32) * rope.theta**exponents)


def _tables(inv_freq: torch.Tensor, max_positions: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
    freqs = torch.outer(positions, inv_freq)
    table = torch.cat([freqs, freqs], dim=-1)
    return table.cos() * scale, table.sin() * scale


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables; ``cos_sin(positions)`` once per step, ``apply`` per layer.

    For longrope the tables hold the short rows then the long rows (``2 * max_positions``).
    """

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.long_after: Optional[int] = None  # longrope: longer sequences use the long rows
        scale = rope_attention_factor(rope)
        cos, sin = _tables(rope_inverse_frequencies(rope, head_dim), max_positions, scale)
        if rope.rope_type == "longrope":
            self.long_after = rope.original_max_position_embeddings
            long_cos, long_sin = _tables(_long_inverse_frequencies(rope, head_dim), max_positions, scale)
            cos, sin = torch.cat([cos, long_cos]), torch.cat([sin, long_sin])
        self.register_buffer("cos_table", cos, persistent=False)
        self.register_buffer("sin_table", sin, persistent=False)

    @property
    def needs_context_lens(self) -> bool:
        """Whether ``cos_sin`` depends on each token's sequence length (longrope)."""
        return self.long_after is not None

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, context_lens: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, shaped [T, 1, head_dim] to broadcast over heads.

        ``context_lens`` [T]: the length of each token's sequence after this step (longrope
        only; None: the longest position here + 1 for every token, transformers' rule).
        """
        rows = positions
        if self.long_after is not None and positions.numel():
            lengths = context_lens if context_lens is not None else positions.max() + 1
            rows = positions + (lengths > self.long_after).to(positions.dtype) * self.max_positions
        cos = self.cos_table.index_select(0, rows).to(dtype).unsqueeze(1)
        sin = self.sin_table.index_select(0, rows).to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, head_dim] by the per-token angles (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
