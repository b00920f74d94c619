"""Counter-based random numbers for seeded requests.

A seeded request's sample at a given position must not depend on which other requests
share the batch. Instead of a stateful generator per row, the random number is a hash of
(seed, position): the same inputs give the same uniform variate whatever the batch, on any
device, with one vectorised computation for all seeded rows.
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


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One uniform variate in (0, 1) per row, determined by the row's (seed, position).

    Float32 with 24 random bits, exactly representable; used to pick a token by inverse
    transform (the first whose cumulative probability exceeds it).
    """
    seeds = seeds.to(torch.int64)
    low, high = seeds & _MASK32, (seeds >> 32) & _MASK32
    key = _mix32(low ^ _mix32(high ^ _mix32(positions.to(torch.int64) & _MASK32)))
    hashed = _mix32(key ^ 0x9E3779B9)
    return ((hashed >> 8).to(torch.float32) + 0.5) * (1.0 / 2**24)
