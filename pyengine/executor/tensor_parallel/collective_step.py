"""One step's forward pass as every rank runs it, failures included.

Every rank runs the same forward on its shard; the layers issue a fixed number of
all-reduces per step (one for the embedding, one for o and one for down in each layer,
all of shape [T, hidden]), then one gather brings the LM head's vocabulary slices to
rank 0, with one extra element per rank: its status (0 ok, 1 failed).

A rank whose step raises (before or between collectives) does not leave the others
waiting: it issues the all-reduces it still owes with zeros and joins the gather with
status 1, its error text in its status slot (``PlanSegment``). Rank 0 then fails the step
naming the rank, and every rank goes on with the next plan, as a failed step does at
tensor-parallel size 1. (The KV entries written in a failed step belong to sequences
that are failed with it.) An error *inside* a collective (a dead peer) is not a step
failure: it propagates and the engine stops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pyengine.models.decoder import DecoderForCausalLM
from pyengine.models.parallel import CollectiveError


@dataclass
class GatheredStep:
    """Rank 0's view after the step's gather."""

    logits: Optional[torch.Tensor]  # [S, vocab] float32 (None on other ranks)
    failed_ranks: list[int]


def all_reduces_per_step(model: DecoderForCausalLM) -> int:
    """The embedding's, plus the attention output's and the MLP's in every layer."""
    return 1 + 2 * len(model.layers)


def run_forward(
    model: DecoderForCausalLM,
    forward: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    num_tokens: int,
    num_logits: int,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[Optional[torch.Tensor], Optional[BaseException], torch.Tensor]:
    """Runs ``forward`` (-> hidden, this rank's logits slice); on an exception, issues the
    all-reduces still owed with zeros. Returns (hidden or None, the error or None, the
    local logits to gather: zeros after an error)."""
    parallel = model.parallel
    parallel.count.all_reduces = 0
    try:
        hidden, local = forward()
        return hidden, None, local
    except CollectiveError:
        raise
    except Exception as error:  # noqa: BLE001 - reported through the gather, step fails everywhere
        owed = all_reduces_per_step(model) - parallel.count.all_reduces
        hidden_size = model.config.hidden_size
        for _ in range(owed):
            parallel.all_reduce(torch.zeros(num_tokens, hidden_size, device=device, dtype=dtype))
        rows = parallel.vocab_rows(model.config.vocab_size)
        return None, error, torch.zeros(num_logits, rows, device=device, dtype=torch.float32)


def gather_logits(model: DecoderForCausalLM, local: torch.Tensor, failed: bool) -> GatheredStep:
    """Gathers every rank's logits slice and status on rank 0 (a collective: all ranks)."""
    parallel = model.parallel
    flat = torch.cat([local.reshape(-1), local.new_full((1,), 1.0 if failed else 0.0)])
    if parallel.rank != 0:
        try:
            torch.distributed.gather(flat, None, dst=0, group=parallel.group)
        except RuntimeError as error:
            raise CollectiveError(f"gathering the logits failed on rank {parallel.rank}: {error}") from error
        return GatheredStep(None, [])
    parts = [torch.empty_like(flat) for _ in range(parallel.world_size)]
    try:
        torch.distributed.gather(flat, parts, dst=0, group=parallel.group)
    except RuntimeError as error:
        raise CollectiveError(f"gathering the logits failed: {error}") from error
    failed_ranks = [rank for rank, part in enumerate(parts) if float(part[-1]) != 0.0]
    vocab = model.config.vocab_size
    logits = torch.cat([part[:-1].view(local.shape) for part in parts], dim=-1)[:, :vocab]
    return GatheredStep(logits, failed_ranks)
