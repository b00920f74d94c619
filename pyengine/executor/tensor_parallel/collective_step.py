"""One step's forward pass as every rank runs it, failures included.

Every rank runs the same forward on its shard; the layers issue a fixed number of
all-reduces per step (one for the embedding, one for o and one for down in each layer,
all of shape [T, hidden]), then one gather brings the LM head's vocabulary slices to
rank 0, each followed by that rank's status: a flag and a short error text
(``encode_message``).

A rank whose step raises (before or between collectives) does not leave the others
waiting: it issues exactly the collectives it still owes (each rank counts the ones it
completed in the step, ``ParallelContext.count``, reset when the step starts): the
all-reduces with zeros, then the gather with its error. Rank 0 then fails the step naming the rank, and every rank goes on with the next plan, as a failed step does at
tensor-parallel size 1. (The KV entries written in a failed step belong to sequences
that are failed with it.) An error *inside* a collective (a dead peer) is not a step
failure: it propagates and the engine stops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pyengine.errors import EngineDeadError
from pyengine.models.decoder import DecoderForCausalLM
from pyengine.models.parallel import CollectiveError, ParallelContext

#: Bytes of error text a rank's status carries (longer messages are cut).
MESSAGE_BYTES = 512


@dataclass
class GatheredStep:
    """Rank 0's view after the step's gather."""

    logits: Optional[torch.Tensor]  # [S, vocab] float32 (None on other ranks)
    failures: dict[int, str]  # rank -> its error


def encode_message(text: str, failed: bool) -> torch.Tensor:
    """A status as float32 [2 + MESSAGE_BYTES]: flag, length, the UTF-8 bytes (exact in float32)."""
    data = text.encode("utf-8", "replace")[:MESSAGE_BYTES]
    status = torch.zeros(2 + MESSAGE_BYTES, dtype=torch.float32)
    status[0] = 1.0 if failed else 0.0
    status[1] = len(data)
    if data:
        status[2 : 2 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).float()
    return status


def decode_message(status: torch.Tensor) -> str:
    length = int(status[1])
    return bytes(status[2 : 2 + length].to(torch.uint8).tolist()).decode("utf-8", "replace")


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
    try:
        hidden, local = forward()
        return hidden, None, local
    except CollectiveError:
        raise
    except Exception as error:  # noqa: BLE001 - reported through the gather, step fails everywhere
        issue_owed_all_reduces(model, num_tokens, device, dtype)
        rows = model.parallel.vocab_rows(model.config.vocab_size)
        return None, error, torch.zeros(num_logits, rows, device=device, dtype=torch.float32)


def issue_owed_all_reduces(model: DecoderForCausalLM, num_tokens: int, device: torch.device, dtype: torch.dtype) -> None:
    """The step's all-reduces this rank has not completed yet, with zeros (the step's
    count, ``ParallelContext.count``, says how many it did)."""
    parallel = model.parallel
    owed = all_reduces_per_step(model) - parallel.count.all_reduces
    if owed < 0:
        raise CollectiveError(f"rank {parallel.rank} issued {-owed} all-reduce(s) more than a step has")
    for _ in range(owed):
        parallel.all_reduce(torch.zeros(num_tokens, model.config.hidden_size, device=device, dtype=dtype))


def gather_logits(model: DecoderForCausalLM, local: torch.Tensor, error: Optional[BaseException]) -> GatheredStep:
    """Gathers every rank's logits slice and status on rank 0 (a collective: all ranks)."""
    parallel = model.parallel
    text = f"{type(error).__name__}: {error}" if error is not None else ""
    status = encode_message(text, error is not None).to(local.device)
    flat = torch.cat([local.reshape(-1), status])
    if parallel.rank != 0:
        _gather(flat, None, parallel)
        return GatheredStep(None, {})
    parts = torch.empty(parallel.world_size, flat.numel(), dtype=flat.dtype, device=flat.device)
    _gather(flat, parts, parallel)
    width = status.numel()
    failures = {
        rank: decode_message(part[-width:].cpu()) for rank, part in enumerate(parts) if float(part[-width]) != 0.0
    }
    vocab = model.config.vocab_size
    logits = torch.cat([part[:-width].view(local.shape) for part in parts], dim=-1)[:, :vocab]
    return GatheredStep(logits, failures)


def _gather(flat: torch.Tensor, parts: Optional[torch.Tensor], parallel: ParallelContext) -> None:
    """Every rank's ``flat`` into row r of ``parts`` ([world, len(flat)], rank 0 only)."""
    try:
        if parallel.local is not None and parallel.local.accepts(flat):
            parallel.local.gather(flat, parts)
        else:
            torch.distributed.gather(flat, None if parts is None else list(parts), dst=0, group=parallel.group)
    except (RuntimeError, EngineDeadError) as error:
        raise CollectiveError(f"gathering the logits failed on rank {parallel.rank}: {error}") from error
    parallel.count.gathers += 1
