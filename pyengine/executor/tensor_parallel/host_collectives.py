"""The forward pass's collectives between the ranks of one host, through shared memory.

The engine's own workers (``distributed_executor_backend="mp"``) run on rank 0's host.
On the CPU, gloo carries their all-reduces over loopback TCP: on a busy 2-core host one
all-reduce of a decode step's activations cost 0.7-1.1 ms, nine per step, more than the
model's compute (docs/tensor_parallel.md has the figures). Here each rank copies its
partial into its slot of one shared segment, announces it, waits for the others (a
bounded wait that watches their processes) and sums every slot in rank order: the same
bits on every rank. The logits gather goes the same way. The work is a native kernel
(``rust_sched/kernels/src/host_group.rs``) that runs with the GIL released.

``torch.distributed`` (gloo) stays the process group: the rendezvous, the start-up's
agreement on the KV cache size, tensors this path does not take (other dtypes, CUDA),
ranks on other hosts (``external_launcher``), and everything when the engine is
configured with ``disable_custom_all_reduce=True`` (vLLM's name for the same switch).

Rank 0 creates the segment (named ``pyengine_tp_<pid>_...``) before it starts the
workers and removes its name as soon as every worker has mapped it, so no exit, not even
a killed process, can leave it behind. It lives in ``/dev/shm`` (a tmpfs): one that is too
full shows up as a SIGBUS on the first touch of a page, not as an exception, so rank 0
checks the free space first and, short of it, lets gloo carry the collectives
(``create_or_none``, with a warning naming the sizes).
"""

from __future__ import annotations

import logging
import os
import secrets
from multiprocessing import resource_tracker, shared_memory
from typing import Optional

import numpy as np
import torch

from pyengine import _kernels

#: Bytes of one rank's slot: larger collectives go through it in chunks.
SLOT_BYTES = 4 << 20
#: Every shared segment of a tensor-parallel group is named ``pyengine_tp_<rank 0's pid>_...``.
SEGMENT_PREFIX = "pyengine_tp"
_ELEMENT = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
#: Where POSIX shared memory (``multiprocessing.shared_memory``) lives on Linux.
SHARED_MEMORY_DIR = "/dev/shm"

logger = logging.getLogger(__name__)


def free_shared_memory_bytes(path: str = SHARED_MEMORY_DIR) -> Optional[int]:
    """Bytes free for an unprivileged writer in the shared-memory tmpfs (None: unknown)."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def segment_name(kind: str) -> str:
    """A fresh segment name for ``kind``, carrying this process's id."""
    return f"{SEGMENT_PREFIX}_{os.getpid()}_{kind}_{secrets.token_hex(4)}"


def map_segment(name: Optional[str], kind: str, size: int) -> shared_memory.SharedMemory:
    """Creates a segment (``name`` None) or maps rank 0's. Python < 3.13 registers a mapped
    segment with this process's resource tracker, which would remove it when this worker
    exits: rank 0 owns it, so it is unregistered here."""
    if name is None:
        return shared_memory.SharedMemory(name=segment_name(kind), create=True, size=size)
    segment = shared_memory.SharedMemory(name=name)
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    return segment


def unlink_segment(segment: shared_memory.SharedMemory) -> None:
    """Removes the segment's name (the mappings stay valid); already gone is fine."""
    try:
        segment.unlink()
    except FileNotFoundError:
        pass


class HostCollectives:
    """This rank's handle on the group's shared segment (``name`` None: rank 0 creates it)."""

    def __init__(
        self, rank: int, world_size: int, timeout_s: float, name: Optional[str] = None, slot_bytes: int = SLOT_BYTES
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.slot_bytes = slot_bytes
        size = _kernels.host_group_bytes(world_size, slot_bytes)
        self.owner = name is None
        self.shm = map_segment(name, "collectives", size)
        self.memory = np.ndarray(size, dtype=np.uint8, buffer=self.shm.buf)
        _kernels.host_group_register(self.memory, rank, world_size, slot_bytes, os.getpid())

    @classmethod
    def create_or_none(cls, world_size: int, timeout_s: float, reserved_bytes: int = 0) -> Optional[HostCollectives]:
        """Rank 0's segment, or None (with a warning) when the shared-memory tmpfs has
        less room than it needs plus ``reserved_bytes`` (other segments made but not yet
        touched): gloo carries the collectives then, slower but without a SIGBUS."""
        needed = _kernels.host_group_bytes(world_size, SLOT_BYTES)
        free = free_shared_memory_bytes()
        if free is not None and free < needed + reserved_bytes:
            logger.warning(
                "tensor parallel: %s has %.1f MiB free, the shared-memory collectives need %.1f MiB (%d ranks x "
                "2 x %.0f MiB slots) besides %.1f MiB for the step plan: gloo carries the all-reduces instead "
                "(a larger /dev/shm, e.g. docker --shm-size, restores them)",
                SHARED_MEMORY_DIR, free / 2**20, needed / 2**20, world_size, SLOT_BYTES / 2**20,
                reserved_bytes / 2**20,
            )
            return None
        return cls(0, world_size, timeout_s)

    @property
    def name(self) -> str:
        return self.shm.name

    def accepts(self, tensor: torch.Tensor) -> bool:
        """Whether this path takes ``tensor`` (every rank decides alike: same device, same dtype)."""
        return tensor.device.type == "cpu" and tensor.dtype in _ELEMENT

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sums ``tensor`` over the ranks in place. Raises ``EngineDeadError`` naming the
        rank when a peer died, gave up or did not come within the timeout."""
        target = tensor if tensor.is_contiguous() else tensor.contiguous()
        _kernels.host_all_reduce(
            self.memory, _bytes(target), _ELEMENT[tensor.dtype], self.rank, self.world_size, self.slot_bytes,
            self.timeout_s,
        )
        if target is not tensor:
            tensor.copy_(target)

    def gather(self, flat: torch.Tensor, out: Optional[torch.Tensor]) -> None:
        """Rank r's ``flat`` into row r of ``out`` ([world, len(flat)], rank 0 only)."""
        _kernels.host_gather(
            self.memory, _bytes(flat.contiguous()), None if out is None else _bytes(out), self.rank,
            self.world_size, self.slot_bytes, self.timeout_s,
        )

    def unlink(self) -> None:
        """Rank 0, once every rank mapped the segment: its name goes, the mappings stay."""
        if self.owner:
            unlink_segment(self.shm)

    def close(self) -> None:
        """Unmaps the segment (rank 0 also removes its name if still there)."""
        self.memory = np.zeros(0, dtype=np.uint8)
        try:
            self.shm.close()
        except BufferError:  # a view still held elsewhere: the mapping goes with the process
            pass
        self.unlink()


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes as a numpy uint8 view."""
    return tensor.reshape(-1).view(torch.uint8).numpy()

