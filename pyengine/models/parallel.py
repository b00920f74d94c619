"""Tensor-parallel context: which shard of each weight this process owns.

Only world size 1 runs today, but the layers are written against a rank / world size so
that tensor parallelism over ``torch.distributed`` only needs a process group here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyengine.errors import InvalidConfigError
from pyengine.models.errors import UnsupportedModelError


@dataclass(frozen=True, slots=True)
class ParallelContext:
    """This process's position in the tensor-parallel group."""

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise InvalidConfigError(
                f"rank must be in [0, world_size), got rank={self.rank} world_size={self.world_size}"
            )

    def shard(self, size: int, what: str) -> int:
        """This rank's share of a dimension that must split evenly (e.g. heads)."""
        if size % self.world_size != 0:
            raise UnsupportedModelError(
                f"{what} ({size}) is not divisible by the tensor-parallel size {self.world_size}"
            )
        return size // self.world_size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum partial results over the group (identity at world size 1)."""
        if self.world_size > 1:
            torch.distributed.all_reduce(tensor)
        return tensor
