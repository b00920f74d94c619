"""Vocabulary-parallel embedding and LM head.

Each rank holds ``ceil(vocab / world_size)`` rows of the embedding matrix (the last rank's
tail padded with zeros when the vocabulary does not divide). The embedding looks up the
ids that fall in this rank's rows, zeros the others and all-reduces: every rank ends with
the full embeddings. The LM head multiplies by the same kind of slice (the embedding's
own when tied) and yields this rank's columns of the logits; ``ParallelContext``'s
gathers put them together.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pyengine.models.layers import WeightTarget
from pyengine.models.parallel import ParallelContext


class VocabParallelEmbedding(torch.nn.Module):
    """Token embeddings, this rank holding a slice of the vocabulary rows."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelContext) -> None:
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.shard = parallel.vocab(vocab_size)
        self.weight = torch.nn.Parameter(torch.empty(parallel.vocab_rows(vocab_size), hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.size)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.parallel.all_reduce(hidden)

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
