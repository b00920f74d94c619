"""Vocabulary-parallel embedding and LM head.

Each rank holds ``ceil(vocab / world_size)`` rows of the embedding matrix (the last rank's
tail padded with zeros when the vocabulary does not divide). The embedding looks up the
ids that fall in this rank's rows, zeros the others and all-reduces: every rank ends with
the full embeddings. The LM head multiplies by the same kind of slice (the embedding's
own when tied) and yields this rank's columns of the logits; ``ParallelContext``'s
gathers put them together.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pyengine.models import cpu_linear
from pyengine.models.layers import WeightTarget
from pyengine.models.parallel import CollectiveError, ParallelContext
from pyengine.models.quantization.linear import QuantizedMatmul


class VocabParallelEmbedding(torch.nn.Module):
    """Token embeddings, this rank holding a slice of the vocabulary rows."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelContext) -> None:
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.shard = parallel.vocab(vocab_size)
        self.weight = torch.nn.Parameter(torch.empty(parallel.vocab_rows(vocab_size), hidden_size))
        # A tied model quantized at load looks its rows up in the LM head's packed weight.
        self.quantized: Optional[QuantizedMatmul] = None
        self.dtype = self.weight.dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.size)
        hidden = self._lookup(local.masked_fill(outside, 0))
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.parallel.all_reduce(hidden)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized.embedding(ids.reshape(-1), self.dtype).view(*ids.shape, -1)
        return F.embedding(ids, self.weight)

    def use_packed(self, quantized: QuantizedMatmul) -> None:
        """Look rows up in ``quantized`` (the tied LM head's packed weight); the dense
        matrix is released."""
        self.dtype = self.weight.dtype
        self.quantized = quantized
        cpu_linear.release_dense(self)

    def weight_targets(self, name: str) -> dict[str, WeightTarget]:
        return {name: vocab_target(self.weight, self.shard.full, self.parallel)}


def vocab_target(weight: torch.nn.Parameter, vocab_size: int, parallel: ParallelContext) -> WeightTarget:
    """The checkpoint rows of a [vocab, hidden] matrix this rank holds, into ``weight``'s first rows."""
    shard = parallel.vocab(vocab_size)
    return WeightTarget(weight, (vocab_size, weight.shape[1]), shard_dim=0, row_offset=0, shard=shard)


def zero_vocab_padding(weight: torch.Tensor, vocab_size: int, parallel: ParallelContext) -> None:
    """Zero the rows past the vocabulary's end (the last rank's padding), never loaded."""
    real = parallel.vocab(vocab_size).size
    with torch.no_grad():
        weight[real:].zero_()


def whole_embedding(embedding: VocabParallelEmbedding) -> Optional[torch.Tensor]:
    """The whole [vocab, hidden] matrix on rank 0 (None on the other ranks), gathered once
    from every rank's slice: a collective, every rank of the group calls it at the same
    point of its start-up. An EAGLE-3 head that shares the target's embedding runs on
    rank 0 alone and looks its tokens up there (``executor/eagle3_proposer.py``). A slice
    looked up in a quantized tied LM head is dequantized row by row here."""
    parallel = embedding.parallel
    vocab = embedding.vocab_size
    rows = torch.arange(parallel.vocab_rows(vocab), device=embedding.weight.device)
    local = embedding._lookup(rows).contiguous()
    if parallel.world_size == 1:
        return local[:vocab]
    parts = [torch.empty_like(local) for _ in range(parallel.world_size)] if parallel.rank == 0 else None
    try:
        torch.distributed.gather(local, parts, dst=0, group=parallel.group)
    except RuntimeError as error:
        raise CollectiveError(f"gathering the embedding failed on rank {parallel.rank}: {error}") from error
    return None if parts is None else torch.cat(parts)[:vocab]
