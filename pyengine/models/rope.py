"""Rotary position embeddings (rotate-half / NeoX layout) with Llama-3, linear and YaRN
scaling (``rope_yarn``)."""

from __future__ import annotations

import math

import torch

from pyengine.models.config import RopeConfig
from pyengine.models.rope_yarn import yarn_attention_factor, yarn_inverse_frequencies


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2] in float32, scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    if rope.rope_type == "yarn":
        return yarn_inverse_frequencies(rope, head_dim)
    return inv_freq


def rope_attention_factor(rope: RopeConfig) -> float:
    """What the cos / sin tables are multiplied by (YaRN's magnitude correction; else 1)."""
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


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables; ``cos_sin(positions)`` once per step, ``apply`` per layer."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        inv_freq = rope_inverse_frequencies(rope, head_dim)
        positions = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
        freqs = torch.outer(positions, inv_freq)
        table = torch.cat([freqs, freqs], dim=-1)
        factor = rope_attention_factor(rope)
        self.register_buffer("cos_table", table.cos() * factor, persistent=False)
        self.register_buffer("sin_table", table.sin() * factor, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, shaped [T, 1, head_dim] to broadcast over heads."""
        cos = self.cos_table.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin_table.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, head_dim] by the per-token angles (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
