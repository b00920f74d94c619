"""YaRN rotary scaling (https://arxiv.org/abs/2309.00071), as DeepSeek-V2/V3 ship it.

Frequencies whose wavelength fits many times in the original context keep their value
(extrapolation), those that fit less than once are divided by ``factor``
(interpolation), and a linear ramp between ``beta_fast`` and ``beta_slow`` rotations
blends the two. The cos/sin tables are multiplied by an attention factor derived from
``mscale`` / ``mscale_all_dim`` (1.0 when they are equal, as in DeepSeek's configs);
DeepSeek's softmax scale takes a further ``mscale_all_dim`` correction, computed by the
attention (``yarn_softmax_scale``). The formulas follow transformers'
``_compute_yarn_parameters`` so that the same config gives the same tables.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # config.py imports this module's users: no import cycle at run time
    from pyengine.models.config import RopeConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context extended ``scale`` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(rope: RopeConfig) -> float:
    """The factor the cos / sin tables are multiplied by."""
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def yarn_softmax_scale(rope: RopeConfig, head_dim: int) -> float:
    """DeepSeek's attention scale: ``head_dim^-0.5``, times ``mscale(factor,
    mscale_all_dim)^2`` under a scaled rope with ``mscale_all_dim`` set."""
    scale = head_dim**-0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


def yarn_inverse_frequencies(rope: RopeConfig, dim: int) -> torch.Tensor:
    """Per-pair inverse frequencies ``[dim // 2]`` (float32) under YaRN scaling."""
    base, original = rope.theta, rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp needs a width
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    frequencies = base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim)
    extrapolated = 1.0 / frequencies
    interpolated = 1.0 / (rope.factor * frequencies)
    return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
