"""The step plan, broadcast once per step from rank 0 to the other ranks of one host.

What a worker rank needs to run the forward pass is a handful of integer arrays: the
input ids (placeholders already filled by rank 0, which knows the tokens it sampled),
positions, KV slots, the rows and their query / sequence lengths, the sampled positions,
the block-table writes (with a hybrid model's per-group tables, each write's table and
each token's slot in tables 1.., ``block_table_groups`` / ``group_slot_mapping``), and
the prompt positions of rows that asked for prompt logprobs
(with their slice size, in the header). Rank 0 writes them one after the other, with one
``np.concatenate`` straight into a shared-memory segment (``multiprocessing.shared_memory``)
sized for the largest possible plan, their lengths into its header, then one byte into
each worker's pipe. A worker wakes on its pipe, reads the header and takes numpy views
of the arrays: nothing is pickled or copied beyond the one write.

Reuse is safe without locks: every published plan has tokens, hence a gather (rank 0
runs a plan without tokens alone, and refuses one that carries block-table writes), and
rank 0 writes plan N+1 only after step N's gather, which every worker reaches only after
it is done with plan N's arrays. The
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

from pyengine import _kernels
from pyengine.executor.tensor_parallel.host_collectives import map_segment, unlink_segment
from pyengine.models.parallel import CollectiveError

# Header: sequence number, step id, then the length of each array below.
_HEADER = ("sequence", "step_id", "tokens", "rows", "logits", "block_writes", "prompt_logits", "prompt_slice",
           "samples", "drafts", "table_writes", "group_slots")
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
    ("prompt_logits_indices", "prompt_logits", 0),
    # Speculative decoding: drafts per sampled sequence (empty without drafts), the drafts.
    ("num_draft_tokens", "samples", 0),
    ("draft_token_ids", "drafts", 0),
    # Per-group tables (a hybrid model; empty otherwise): each write's table, and each
    # token's slot in tables 1.. ([tokens, tables - 1] flattened).
    ("block_table_groups", "table_writes", 0),
    ("group_slot_mapping", "group_slots", 0),
)
_NO_POSITIONS = np.zeros(0, dtype=np.int64)
EXIT_BYTE = b"x"
STEP_BYTE = b"s"
#: How long a worker polls for the next plan before it sleeps on its step pipe.
POLL_S = 0.002


@dataclass(frozen=True)
class PlanCapacity:
    """The largest plan a step can carry (from the engine's limits; ``max_block_writes``
    counts every table's, ``num_tables`` the per-group tables of a hybrid model)."""

    max_tokens: int
    max_rows: int
    max_block_writes: int
    num_tables: int = 1

    def lengths(self) -> dict[str, int]:
        return {"tokens": self.max_tokens, "rows": self.max_rows,
                "logits": self.max_tokens, "block_writes": self.max_block_writes, "prompt_logits": self.max_tokens,
                "samples": self.max_rows, "drafts": self.max_tokens,
                "table_writes": self.max_block_writes if self.num_tables > 1 else 0,
                "group_slots": self.max_tokens * (self.num_tables - 1)}


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
    # Prompt positions whose logits follow the sampled ones, gathered in slices of
    # ``prompt_slice`` (prompt_logprobs; see ``executor.prompt_logprobs``).
    prompt_logits_indices: np.ndarray
    prompt_slice: int
    num_draft_tokens: np.ndarray
    draft_token_ids: np.ndarray
    block_table_groups: np.ndarray
    group_slot_mapping: np.ndarray


def plan_lengths(plan: Any, input_ids: np.ndarray) -> dict[str, int]:
    """The length fields of ``plan`` (see ``ARRAYS``)."""
    return {"tokens": len(input_ids), "rows": len(plan.rows), "logits": len(plan.logits_indices),
            "block_writes": len(plan.block_table_rows), "prompt_logits": len(prompt_positions(plan)),
            "samples": len(draft_counts(plan)), "drafts": len(draft_ids(plan)),
            "table_writes": len(table_groups(plan)), "group_slots": len(group_slots(plan))}


def draft_counts(plan: Any) -> np.ndarray:
    """The plan's drafts per sampled sequence (none for a plan without them)."""
    return getattr(plan, "num_draft_tokens", _NO_POSITIONS)


def draft_ids(plan: Any) -> np.ndarray:
    """The plan's drafts, flat (none for a plan without them)."""
    return getattr(plan, "draft_token_ids", _NO_POSITIONS)


def table_groups(plan: Any) -> np.ndarray:
    """Each block-table write's table (none for a plan with one table)."""
    return getattr(plan, "block_table_groups", _NO_POSITIONS)


def group_slots(plan: Any) -> np.ndarray:
    """Each token's slot in tables 1.. (none for a plan with one table)."""
    return getattr(plan, "group_slot_mapping", _NO_POSITIONS)


def prompt_positions(plan: Any) -> np.ndarray:
    """The plan's prompt positions (``PromptPositionsPlan``), none for a plain plan."""
    return getattr(plan, "prompt_logits_indices", _NO_POSITIONS)


class PlanSegment:
    """The shared segment's layout: a header, one "asleep" word per worker (raised while
    that worker sleeps on its step pipe), then the arrays one after the other (in
    ``ARRAYS`` order, int64), as long as the header says; room for the largest plan."""

    def __init__(self, capacity: PlanCapacity, name: Optional[str] = None, workers: int = 1) -> None:
        self.capacity = capacity
        lengths = capacity.lengths()
        elements = sum(lengths[field] + extra for _, field, extra in ARRAYS)
        size = 8 * (len(_HEADER) + workers + elements)
        self.shm = map_segment(name, "plan", size)
        self.owner = name is None
        self.header = np.ndarray(len(_HEADER), dtype=np.int64, buffer=self.shm.buf)
        self.asleep = np.ndarray(workers, dtype=np.int64, buffer=self.shm.buf, offset=8 * len(_HEADER))
        self._area = np.ndarray(elements, dtype=np.int64, buffer=self.shm.buf, offset=8 * (len(_HEADER) + workers))

    @property
    def name(self) -> str:
        return self.shm.name

    def write(self, plan: Any, input_ids: np.ndarray) -> None:
        """Rank 0: the plan's arrays (``input_ids`` with placeholders filled) into the
        segment, in one copy (``np.concatenate`` straight into it)."""
        tokens, rows = len(input_ids), len(plan.rows)
        logits, block_writes = len(plan.logits_indices), len(plan.block_table_rows)
        prompt = prompt_positions(plan)
        counts, drafts = draft_counts(plan), draft_ids(plan)
        groups, slots = table_groups(plan), group_slots(plan)
        total = (3 * tokens + 4 * rows + 1 + logits + 3 * block_writes + len(prompt) + len(counts) + len(drafts)
                 + len(groups) + len(slots))
        np.concatenate(
            (input_ids, plan.positions, plan.slot_mapping, plan.rows, plan.num_scheduled_tokens, plan.seq_lens,
             plan.query_start_loc, plan.logits_indices, plan.block_table_rows, plan.block_table_cols,
             plan.block_table_ids, prompt, counts, drafts, groups, slots),
            out=self._area[:total],
        )
        self.header[1:] = (plan.step_id, tokens, rows, logits, block_writes, len(prompt),
                           getattr(plan, "prompt_slice", 0), len(counts), len(drafts), len(groups), len(slots))
        _kernels.shared_word_advance(self.header, 0)  # a reader that sees it sees the arrays

    def read(self) -> ForwardPlan:
        """A worker: views of the plan last written."""
        plan = ForwardPlan()
        sizes = dict(zip(_HEADER, self.header.tolist()))
        plan.step_id = sizes["step_id"]
        plan.prompt_slice = sizes["prompt_slice"]
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
        self.asleep = np.zeros(0, dtype=np.int64)
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
    """Rank 0's side: write the plan into the segment, then wake each worker that sleeps
    on its pipe (``wakes[i]`` writes one byte into worker i's pipe; a worker that polls
    takes the plan without it)."""

    def __init__(self, segment: PlanSegment, wakes: list[Callable[[bytes], None]]) -> None:
        self.segment = segment
        self.wakes = wakes

    def publish(self, plan: Any, input_ids: np.ndarray) -> None:
        self.segment.write(plan, input_ids)
        for index, wake in enumerate(self.wakes):
            if _kernels.shared_word_read(self.segment.asleep, index):
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
    """A worker's side (worker ``index``, rank ``index + 1``): ``receive`` blocks until the
    next plan (None: told to exit).

    It first polls the header's sequence number for ``poll_s`` (spinning, then yielding
    its core; native, GIL released): while steps follow each other the next plan lands
    within that window and rank 0 writes no pipe at all (the wake-up of a sleeping worker
    preempted rank 0 for about 0.4 ms a step on a 2-core host). Then it raises its
    "asleep" word, looks at the sequence once more, and sleeps on its pipe; rank 0 writes
    the pipe to a worker whose word is up (``rust_sched/kernels/src/sequence_word.rs`` says why
    no plan can be missed). Step bytes are hints: a byte whose plan was taken already is
    ignored, and bytes left in the pipe are read off after a plan (so it never fills);
    the exit byte and a closed pipe (rank 0 gone, which raises) are commands, wherever
    they are read. A plan whose sequence number is not the one after the last raises
    ``PlanSequenceError``."""

    def __init__(self, segment: PlanSegment, signal: "StepSignal", index: int = 0, poll_s: float = POLL_S) -> None:
        self.segment = segment
        self.signal = signal
        self.index = index
        self.poll_s = poll_s
        # Rank 0 creates the segment zeroed and counts every plan from 1. A worker may
        # attach after rank 0 has already published its first plan (rank 0 does not wait
        # for the worker's "ready"), so the count starts at 0, not at what is there now.
        self.last_sequence = 0
        self._told: Optional[bytes] = None  # EXIT_BYTE or b"" (closed) read while draining

    def receive(self) -> Optional[ForwardPlan]:
        header, asleep = self.segment.header, self.segment.asleep
        while True:
            if self._told is not None:
                return self._obey(self._told)
            sequence = _kernels.shared_word_wait_past(header, 0, self.last_sequence, self.poll_s)
            if sequence is None:
                _kernels.shared_word_write(asleep, self.index, 1)
                sequence = _kernels.shared_word_read(header, 0)
                if sequence == self.last_sequence:
                    byte = self.signal.wait(1.0)
                    _kernels.shared_word_write(asleep, self.index, 0)
                    if byte in (EXIT_BYTE, b""):
                        return self._obey(byte)
                    continue  # a step byte, or a quiet second: look at the sequence again
                _kernels.shared_word_write(asleep, self.index, 0)
            for byte in self.signal.drain():
                if byte != STEP_BYTE:
                    self._told = byte
            return self._take(sequence)

    def _obey(self, byte: bytes) -> None:
        if byte == EXIT_BYTE:
            return None
        raise CollectiveError("rank 0 closed the step pipe (the engine process is gone)")

    def _take(self, sequence: int) -> ForwardPlan:
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

    def drain(self) -> list[bytes]:
        """Every byte already in the pipe, without waiting (b"" last when it is closed)."""
        found: list[bytes] = []
        while select.select([self.read_fd], [], [], 0)[0]:
            try:
                chunk = os.read(self.read_fd, 4096)
            except OSError:
                chunk = b""
            if not chunk:
                return [*found, b""]
            found.extend(chunk[i : i + 1] for i in range(len(chunk)))
            if len(chunk) < 4096:
                break
        return found
