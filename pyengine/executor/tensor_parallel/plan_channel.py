"""The step plan, broadcast once per step from rank 0 to the other ranks of one host.

What a worker rank needs to run the forward pass is a handful of integer arrays: the
input ids (placeholders already filled by rank 0, which knows the tokens it sampled),
positions, KV slots, the rows and their query / sequence lengths, the sampled positions
and the block-table writes. Rank 0 writes them one after the other, with one
``np.concatenate`` straight into a shared-memory segment (``multiprocessing.shared_memory``)
sized for the largest possible plan, their lengths into its header, then one byte into
each worker's pipe. A worker wakes on its pipe, reads the header and takes numpy views
of the arrays: nothing is pickled or copied beyond the one write.

Reuse is safe without locks: rank 0 writes plan N+1 only after step N's last
collective, which every worker reaches only after it is done with plan N's arrays. The
header's sequence number (written last) checks it: a worker that finds any number but
the one after the plan it ran last (a plan skipped or read twice) stops with
:class:`PlanSequenceError` instead of running a plan out of step with rank 0.
"""

from __future__ import annotations

import ctypes
import os
import select
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from pyengine.executor.tensor_parallel.host_collectives import map_segment, unlink_segment
from pyengine.models.parallel import CollectiveError

# Header: sequence number, step id, then the length of each array below.
_HEADER = ("sequence", "step_id", "tokens", "rows", "logits", "block_writes")
ARRAYS = (
    # name, length field, extra elements
    ("input_ids", "tokens", 0),
    ("positions", "tokens", 0),
    ("slot_mapping", "tokens", 0),
    ("rows", "rows", 0),
    ("num_scheduled_tokens", "rows", 0),
    ("seq_lens", "rows", 0),
    ("query_start_loc", "rows", 1),
    ("logits_indices", "logits", 0),
    ("block_table_rows", "block_writes", 0),
    ("block_table_cols", "block_writes", 0),
    ("block_table_ids", "block_writes", 0),
)
EXIT_BYTE = b"x"
STEP_BYTE = b"s"


@dataclass(frozen=True)
class PlanCapacity:
    """The largest plan a step can carry (from the engine's limits)."""

    max_tokens: int
    max_rows: int
    max_block_writes: int

    def lengths(self) -> dict[str, int]:
        return {"tokens": self.max_tokens, "rows": self.max_rows,
                "logits": self.max_tokens, "block_writes": self.max_block_writes}


class ForwardPlan:
    """A worker's view of one step's plan: attributes named as in ``StepPlanLike``
    (int64 numpy views into the shared segment, valid until the step's last collective)."""

    step_id: int
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    rows: np.ndarray
    num_scheduled_tokens: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    logits_indices: np.ndarray
    block_table_rows: np.ndarray
    block_table_cols: np.ndarray
    block_table_ids: np.ndarray


def plan_lengths(plan: Any, input_ids: np.ndarray) -> dict[str, int]:
    """The length fields of ``plan`` (see ``ARRAYS``)."""
    return {"tokens": len(input_ids), "rows": len(plan.rows), "logits": len(plan.logits_indices),
            "block_writes": len(plan.block_table_rows)}


class PlanSegment:
    """The shared segment's layout: a header, then the arrays one after the other (in
    ``ARRAYS`` order, int64), as long as the header says; room for the largest plan."""

    def __init__(self, capacity: PlanCapacity, name: Optional[str] = None) -> None:
        self.capacity = capacity
        lengths = capacity.lengths()
        elements = sum(lengths[field] + extra for _, field, extra in ARRAYS)
        size = 8 * (len(_HEADER) + elements)
        self.shm = map_segment(name, "plan", size)
        self.owner = name is None
        self.header = np.ndarray(len(_HEADER), dtype=np.int64, buffer=self.shm.buf)
        self._area = np.ndarray(elements, dtype=np.int64, buffer=self.shm.buf, offset=8 * len(_HEADER))

    @property
    def name(self) -> str:
        return self.shm.name

    def write(self, plan: Any, input_ids: np.ndarray) -> None:
        """Rank 0: the plan's arrays (``input_ids`` with placeholders filled) into the
        segment, in one copy (``np.concatenate`` straight into it)."""
        tokens, rows = len(input_ids), len(plan.rows)
        logits, block_writes = len(plan.logits_indices), len(plan.block_table_rows)
        total = 3 * tokens + 4 * rows + 1 + logits + 3 * block_writes
        np.concatenate(
            (input_ids, plan.positions, plan.slot_mapping, plan.rows, plan.num_scheduled_tokens, plan.seq_lens,
             plan.query_start_loc, plan.logits_indices, plan.block_table_rows, plan.block_table_cols,
             plan.block_table_ids),
            out=self._area[:total],
        )
        self.header[1:] = (plan.step_id, tokens, rows, logits, block_writes)
        self.header[0] += 1

    def read(self) -> ForwardPlan:
        """A worker: views of the plan last written."""
        plan = ForwardPlan()
        sizes = dict(zip(_HEADER, self.header.tolist()))
        plan.step_id = sizes["step_id"]
        offset = 0
        for array, field, extra in ARRAYS:
            end = offset + sizes[field] + extra
            setattr(plan, array, self._area[offset:end])
            offset = end
        return plan

    def unlink(self) -> None:
        """Rank 0, once every worker mapped the segment: its name goes, the mappings stay."""
        if self.owner:
            unlink_segment(self.shm)

    def close(self) -> None:
        """Drop the views and unmap; the creator also removes the segment."""
        self.header = np.zeros(0, dtype=np.int64)
        self._area = np.zeros(0, dtype=np.int64)
        self.shm.close()
        self.unlink()


class StepPipeWriter:
    """Rank 0's end of a worker's step pipe. The byte is written by libc's ``write``
    called *with the GIL held* (``ctypes.PyDLL``): ``os.write`` releases the GIL, and
    getting it back from the output thread, busy with the previous step's event at that
    very moment, can cost the executor thread up to a switch interval (5 ms). The pipe is
    non-blocking, so a worker that stopped reading can never block the GIL holder."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self._write = ctypes.PyDLL(None).write
        self._write.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
        self._write.restype = ctypes.c_ssize_t

    def send(self, byte: bytes) -> bool:
        """False when the byte could not be written (the worker is gone or not reading)."""
        return self._write(self.fd, byte, 1) == 1

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


class SharedMemoryPlanSender:
    """Rank 0's side: write the plan into the segment, then wake each worker (``wake``
    writes one byte into that worker's pipe)."""

    def __init__(self, segment: PlanSegment, wakes: list[Callable[[bytes], None]]) -> None:
        self.segment = segment
        self.wakes = wakes

    def publish(self, plan: Any, input_ids: np.ndarray) -> None:
        self.segment.write(plan, input_ids)
        for wake in self.wakes:
            wake(STEP_BYTE)

    def close(self, timeout_s: float = 0.0) -> None:
        """The workers' exit byte (they are reaped by rank 0's runner, within its timeout)."""
        for wake in self.wakes:
            wake(EXIT_BYTE)
        self.segment.close()


class PlanSequenceError(CollectiveError):
    """A worker found a plan other than the next one in the segment: it is out of step
    with rank 0 and stops (rank 0 then reports the worker's exit)."""


class SharedMemoryPlanReceiver:
    """A worker's side: ``receive`` blocks until the next plan (None: told to exit).
    A closed pipe (rank 0 gone) raises, so a worker never outlives it; so does a plan
    whose sequence number is not the one after the last (``PlanSequenceError``)."""

    def __init__(self, segment: PlanSegment, signal: "StepSignal") -> None:
        self.segment = segment
        self.signal = signal
        # Rank 0 creates the segment zeroed and counts every plan from 1. A worker may
        # attach after rank 0 has already published its first plan (rank 0 does not wait
        # for the worker's "ready"), so the count starts at 0, not at what is there now.
        self.last_sequence = 0

    def receive(self) -> Optional[ForwardPlan]:
        while True:
            byte = self.signal.wait(1.0)
            if byte is None:
                continue
            if byte == EXIT_BYTE:
                return None
            if byte == b"":
                raise CollectiveError("rank 0 closed the step pipe (the engine process is gone)")
            sequence = int(self.segment.header[0])
            if sequence != self.last_sequence + 1:
                raise PlanSequenceError(
                    f"plan sequence {sequence} in the shared segment, expected {self.last_sequence + 1}: "
                    "this worker is out of step with rank 0"
                )
            self.last_sequence = sequence
            return self.segment.read()


class StepSignal:
    """Rank 0 -> one worker: a byte per step on a pipe (``STEP_BYTE``; ``EXIT_BYTE`` to
    stop). A closed pipe (rank 0 gone) reads as exit, so a worker never outlives it."""

    def __init__(self, read_fd: int) -> None:
        self.read_fd = read_fd

    def wait(self, timeout: float) -> Optional[bytes]:
        """The next byte; b"" when rank 0 closed the pipe; None on timeout."""
        ready, _, _ = select.select([self.read_fd], [], [], timeout)
        if not ready:
            return None
        try:
            return os.read(self.read_fd, 1)
        except OSError:
            return b""
