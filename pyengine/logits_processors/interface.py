"""The logits-processor interface: a processor sees the whole step's logits at once.

Modelled on vLLM v1's (``vllm.v1.sample.logits_processor``), so that a processor written
for vLLM ports by changing its imports. A processor keeps per-request state indexed by
*batch index*; before each step the executor tells it how the batch changed
(:class:`BatchUpdate`: requests removed, added, moved), then calls :meth:`apply` with a
``[num_samples, vocab]`` float32 logits tensor whose row ``i`` is batch index ``i``.

pyengine's batch index is the position of the request's sample in the step's logits.
Requests that hold state but sample nothing in a step (a prompt between prefill chunks,
a sequence the token budget left out) sit at indices ``>= logits.shape[0]``: a processor
must only touch the indices below ``logits.shape[0]`` (the built-in ones show how).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING, Any, Optional

from pyengine.sampling_params import SamplingParams

if TYPE_CHECKING:  # torch only in annotations: a front end names processors without it
    import numpy as np
    import torch

__all__ = [
    "AddedRequest",
    "BatchUpdate",
    "LogitsProcessor",
    "MoveDirectionality",
    "MovedRequest",
    "RemovedRequest",
]


class MoveDirectionality(Enum):
    """How a request moves inside the batch."""

    UNIDIRECTIONAL = auto()  # the request at index a moves to b (b was free)
    SWAP = auto()  # the requests at a and b trade places


#: Batch index of a request that left the batch.
RemovedRequest = int
#: (index, params, prompt token ids, output token ids) of a request that joined the batch.
#: The output list is the request's own running list (see ``BatchUpdate``).
AddedRequest = tuple[int, SamplingParams, Optional[list[int]], list[int]]
#: (index a, index b, directionality).
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the previous step; process in this order:
    ``removed``, then ``added``, then ``moved`` (an added or moved request may take the
    index of one removed in the same update).

    ``batch_size``: requests holding an index after the update (indices ``0 ..
    batch_size - 1``). The ``output_tok_ids`` list of an added request is appended to
    after every step it samples in, so a processor that keeps it sees the request's
    outputs so far (it is kept only when a processor other than the built-in ones is
    installed: the built-in ones track what they need in tensors, see
    :meth:`LogitsProcessor.record_sampled`)."""

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]
    #: pyengine's addition: the same moves as one permutation (None when built by hand):
    #: after the update, index ``j < batch_size`` holds what index ``permutation[j]`` held
    #: after ``removed`` and ``added`` (an int64 numpy array). The built-in processors
    #: apply it with one indexed copy per table (``index_state``) and never read
    #: ``moved``, which the engine then lists (in Python) only for a processor that reads it.
    permutation: Optional["np.ndarray"] = None


class PermutationMoves(Sequence[MovedRequest]):
    """``BatchUpdate.moved`` of a permutation: the swaps and one-way moves that, applied in
    order, leave index ``j`` holding what ``permutation[j]`` held (indices not in the
    permutation hold nothing before, and ``len(permutation)`` and above nothing after).
    Listed on first use."""

    def __init__(self, permutation: "np.ndarray") -> None:
        self._permutation = permutation
        self._moves: Optional[list[MovedRequest]] = None

    def _list(self) -> list[MovedRequest]:
        if self._moves is None:
            self._moves = moves_of_permutation(self._permutation.tolist())
        return self._moves

    def __getitem__(self, i):  # type: ignore[override]
        return self._list()[i]

    def __len__(self) -> int:
        return len(self._list())

    def __iter__(self):  # type: ignore[override]
        return iter(self._list())

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    def __repr__(self) -> str:
        return repr(self._list())


def moves_of_permutation(permutation: list[int]) -> list[MovedRequest]:
    """Moves (see ``PermutationMoves``) in index order: index ``j`` gets its request from
    wherever it is now, by a swap when ``j`` holds another, else one way."""
    holder: dict[int, int] = {index: index for index in permutation}  # slot -> the request (its first index)
    where = dict(holder)  # request -> its slot now
    moves: list[MovedRequest] = []
    for target, wanted in enumerate(permutation):
        source = where[wanted]
        if source == target:
            continue
        other = holder.get(target)
        holder[target], where[wanted] = wanted, target
        if other is None:
            del holder[source]
            moves.append((source, target, MoveDirectionality.UNIDIRECTIONAL))
        else:
            holder[source], where[other] = other, source
            moves.append((source, target, MoveDirectionality.SWAP))
    return moves


class LogitsProcessor(ABC):
    """Base class of every logits processor, built-in or custom.

    The engine builds one instance per processor class, in the executor thread (on
    tensor-parallel rank 0 only), as ``cls(config, device, is_pin_memory)`` where
    ``config`` is the executor's :class:`~pyengine.executor.config.ExecutorConfig`
    (``max_num_seqs`` bounds the batch). Per-request arguments come in
    ``SamplingParams.extra_args``; :meth:`validate_params` checks them when a request is
    added, so that a bad one is refused (``InvalidRequestError``) before it is queued.
    """

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ``ValueError`` (or ``InvalidRequestError``) for parameters this processor
        cannot serve. Runs in the caller's thread when a request is added."""
        return None

    @abstractmethod
    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when the processor never changes which token has the largest logit (it may
        then be skipped in a step where every row decodes greedily)."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        """Called before every :meth:`apply`; ``batch_update`` is None when the batch did
        not change."""
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed logits ``[num_samples, vocab]`` (may modify ``logits`` in place
        and return it)."""
        raise NotImplementedError

    def record_sampled(self, token_ids: torch.Tensor) -> None:
        """pyengine's addition to vLLM's interface: the tokens sampled this step, int64
        ``[num_samples]`` on the device, row ``i`` for batch index ``i``. The default does
        nothing; the built-in processors use it to keep their per-request counters and
        recent tokens in tensors instead of reading Python lists every step."""
        return None
