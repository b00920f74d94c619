"""Tensor-parallel context: which shard of each weight this process owns.

The layers are written against a rank and a world size that may be 1. At world size 1
every collective is the identity and nothing touches ``torch.distributed``; above it the
process group must be initialised (``pyengine.executor.tensor_parallel``) before the first
forward pass.

How the model splits (Megatron-style): q/k/v and gate/up are column-parallel (each rank
owns a slice of the heads / intermediate features), o and down are row-parallel (each rank
owns the matching slice of the input features and one all-reduce sums the partial
outputs), the embedding and the LM head are vocabulary-parallel (each rank owns a slice of
the vocabulary rows). KV heads split across ranks like the query heads; a model with fewer
KV heads than ranks keeps each KV head on ``world_size / num_kv_heads`` ranks (replicated).

A mixture-of-experts layer's routed experts split one of two ways: by default each rank
holds a slice of every expert (like the dense MLP); with ``expert_parallel`` each rank
holds ``num_experts / world_size`` whole experts (:meth:`ParallelContext.experts`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from pyengine.errors import EngineDeadError, InvalidConfigError


class CollectiveError(EngineDeadError):
    """A collective itself failed (a peer process died, the group broke): the
    tensor-parallel group cannot run another step."""


@dataclass(frozen=True, slots=True)
class Shard:
    """Rows ``[start, start + size)`` of a dimension of ``full`` rows."""

    full: int
    start: int
    size: int


class CollectiveCount:
    """The collectives this rank completed in the current step (reset when a step
    starts): a rank whose step fails half-way issues exactly the rest, the all-reduces
    with zeros and the gather with its error (``tensor_parallel.collective_step``), so
    that the ranks stay in step and none waits in a collective that will not come."""

    __slots__ = ("all_reduces", "gathers")

    def __init__(self) -> None:
        self.all_reduces = 0
        self.gathers = 0

    def reset(self) -> None:
        self.all_reduces = 0
        self.gathers = 0


@dataclass(frozen=True, slots=True)
class ParallelContext:
    """This process's position in the tensor-parallel group (``group`` None: the default
    process group of ``torch.distributed``). ``local``: the shared-memory collectives of
    ranks on one host (``executor.tensor_parallel.host_collectives.HostCollectives``),
    used for the tensors it ``accepts``; None: every collective goes through
    ``torch.distributed``. ``expert_parallel``: routed experts are split whole across
    the ranks instead of sliced (``enable_expert_parallel``)."""

    rank: int = 0
    world_size: int = 1
    group: Optional[Any] = None
    count: CollectiveCount = field(default_factory=CollectiveCount, compare=False)
    local: Optional[Any] = field(default=None, compare=False)
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise InvalidConfigError(
                f"rank must be in [0, world_size), got rank={self.rank} world_size={self.world_size}"
            )

    def shard(self, size: int, what: str) -> int:
        """This rank's share of a dimension that must split evenly (e.g. heads)."""
        return self.split(size, what).size

    def split(self, size: int, what: str) -> Shard:
        """This rank's rows of a dimension that must split evenly."""
        if size % self.world_size != 0:
            raise InvalidConfigError(
                f"{what} ({size}) is not divisible by the tensor-parallel size {self.world_size}"
            )
        local = size // self.world_size
        return Shard(size, self.rank * local, local)

    def kv_heads(self, num_kv_heads: int) -> Shard:
        """The KV heads this rank holds: an even split when there are at least as many heads
        as ranks, else one head shared by ``world_size / num_kv_heads`` consecutive ranks."""
        if num_kv_heads >= self.world_size:
            return self.split(num_kv_heads, "num_key_value_heads")
        if self.world_size % num_kv_heads != 0:
            raise InvalidConfigError(
                f"num_key_value_heads ({num_kv_heads}) must divide the tensor-parallel size "
                f"{self.world_size} when it is smaller"
            )
        return Shard(num_kv_heads, self.rank // (self.world_size // num_kv_heads), 1)

    def experts(self, num_experts: int) -> Shard:
        """The routed experts this rank holds whole: all of them unless ``expert_parallel``,
        then an even share, consecutive (rank r: experts ``[r E/N, (r+1) E/N)``)."""
        if not self.expert_parallel:
            return Shard(num_experts, 0, num_experts)
        if num_experts % self.world_size != 0:
            raise InvalidConfigError(
                f"enable_expert_parallel: the {num_experts} routed experts do not split evenly over "
                f"tensor_parallel_size={self.world_size} ranks (each rank holds whole experts); choose a size "
                f"that divides {num_experts}, or leave enable_expert_parallel off to slice every expert"
            )
        local = num_experts // self.world_size
        return Shard(num_experts, self.rank * local, local)

    def vocab(self, vocab_size: int) -> Shard:
        """This rank's vocabulary rows: ``ceil(vocab / world)`` per rank, the last rank's
        slice shorter when the vocabulary does not divide (its parameter is padded)."""
        per_rank = -(-vocab_size // self.world_size)
        start = min(self.rank * per_rank, vocab_size)
        return Shard(vocab_size, start, min(per_rank, vocab_size - start))

    def vocab_rows(self, vocab_size: int) -> int:
        """Rows of this rank's (padded) vocabulary-parallel parameter."""
        return -(-vocab_size // self.world_size)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum partial results over the group, in place (identity at world size 1)."""
        if self.world_size > 1:
            try:
                if self.local is not None and self.local.accepts(tensor):
                    self.local.all_reduce(tensor)
                else:
                    torch.distributed.all_reduce(tensor, group=self.group)
            # gloo / NCCL report a lost peer as RuntimeError, the host collectives as EngineDeadError
            except (RuntimeError, EngineDeadError) as error:
                raise CollectiveError(f"all-reduce failed on rank {self.rank}: {error}") from error
            self.count.all_reduces += 1
        return tensor

    def all_gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[N, vocab] from each rank's [N, vocab_rows] slice (identity at world size 1)."""
        if self.world_size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        try:
            torch.distributed.all_gather(parts, local.contiguous(), group=self.group)
        except RuntimeError as error:
            raise CollectiveError(f"all-gather failed on rank {self.rank}: {error}") from error
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` over the group (e.g. KV blocks every rank can hold)."""
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        try:
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN, group=self.group)
        except RuntimeError as error:
            raise CollectiveError(f"agreeing on a value failed on rank {self.rank}: {error}") from error
        return int(tensor[0])
