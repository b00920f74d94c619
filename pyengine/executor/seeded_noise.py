"""Counter-based random noise for seeded requests.

A seeded request's sample at a given position must not depend on which other requests
share the batch. Instead of a stateful generator per row, the noise is a hash of
(seed, position, token id): the same inputs give the same exponential variates whatever
the batch, on any device, with one vectorised computation for all seeded rows.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_MULTIPLIER = 0x45D9F3B  # < 2**27, so products of 32-bit values stay inside int64


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Integer avalanche on values in [0, 2**32) held in int64."""
    x = ((x ^ (x >> 16)) * _MULTIPLIER) & _MASK32
    x = ((x ^ (x >> 16)) * _MULTIPLIER) & _MASK32
    return x ^ (x >> 16)


def seeded_exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) variates ``[rows, vocab]`` determined by each row's (seed, position).

    Used in the exponential race ``argmax(probs / noise)``, which samples from ``probs``.
    """
    device = seeds.device
    seeds = seeds.to(torch.int64)
    low, high = seeds & _MASK32, (seeds >> 32) & _MASK32
    key = _mix32(low ^ _mix32(high ^ _mix32(positions.to(torch.int64) & _MASK32)))
    tokens = _mix32(torch.arange(vocab_size, device=device, dtype=torch.int64) ^ 0x9E3779B9)
    hashed = _mix32(key[:, None] ^ tokens[None, :])
    hashed = _mix32(hashed ^ (key[:, None] * 31 & _MASK32))
    # 24 random bits -> uniform in (0, 1), exactly representable in float32.
    uniform = ((hashed >> 8).to(torch.float32) + 0.5) * (1.0 / 2**24)
    return -torch.log(uniform)
