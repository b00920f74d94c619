"""A stand-in executor for the scheduler: deterministic "samples", no model.

``pyengine simulate`` drives the real scheduler thread with it, so it belongs to the
product; tests and benchmarks reuse it. The token a sequence samples at a position is a
hash of (sequence id, position), the same function as the scheduler crate's
``sim::fake_token``, so the token streams of a workload do not depend on batching,
pipeline depth or preemption. It also checks what a real executor relies on: a
placeholder input only where the row sampled in the previous plan.

Under a grammar (a plan with a ``grammar_mask``) it applies the mask as a real executor
does: a constrained sample takes the allowed token picked by the same hash (the k-th
allowed one), so constrained requests on a synthetic engine follow their grammar instead
of dead-ending on the first refused token. Unconstrained samples are unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from pyengine._sched import PLACEHOLDER_TOKEN, Request, SchedulerThread, StepPlan

_M64 = (1 << 64) - 1

#: How long a synthetic executor waits for a step's grammar mask (as the real one).
MASK_TIMEOUT_S = 30.0


def fake_tokens(seq_ids: np.ndarray, positions: np.ndarray, vocab: int) -> np.ndarray:
    """Vectorised twin of ``pyengine_sched::sim::fake_token`` (rust_sched/sched/src/sim.rs)."""
    with np.errstate(over="ignore"):
        x = (seq_ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ (
            positions.astype(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F)
        )
        x ^= x >> np.uint64(29)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(32)
    return (x % np.uint64(vocab)).astype(np.int64)


def allowed_pick(bits: np.ndarray, vocab: int, seq_ids: np.ndarray, positions: np.ndarray,
                 fallback: np.ndarray) -> np.ndarray:
    """Per row of the packed mask ``bits`` (``[M, words]`` uint32, bit ``t % 32`` of word
    ``t / 32`` allows token t), the allowed token chosen by the (sequence, position) hash;
    ``fallback`` where no token under ``vocab`` is allowed."""
    allowed = np.unpackbits(np.ascontiguousarray(bits, dtype="<u4").view(np.uint8), axis=1, bitorder="little")
    allowed = allowed[:, :vocab].astype(bool)
    counts = allowed.sum(axis=1)
    k = fake_tokens(seq_ids, positions, 1 << 30) % np.maximum(counts, 1)
    picked = (np.cumsum(allowed, axis=1) > k[:, None]).argmax(axis=1)
    return np.where(counts > 0, picked, fallback).astype(np.int64)


class FakeExecutor:
    """Follows plans like the real executor: a row table and the previous samples."""

    def __init__(self, vocab: int = 1000, max_rows: int = 1 << 16) -> None:
        self.vocab = vocab
        self.row_seq = np.full(max_rows, -1, dtype=np.int64)
        self.last_sampled = np.full(max_rows, -1, dtype=np.int64)
        self.steps = 0

    def run(self, plan: StepPlan) -> np.ndarray:
        """Returns the sampled ids for ``plan`` in ``logits_indices`` order."""
        self.row_seq[plan.new_rows] = plan.new_seq_ids.astype(np.int64)
        self.last_sampled[plan.new_rows] = -1
        placeholders = np.flatnonzero(plan.input_ids == PLACEHOLDER_TOKEN)
        if placeholders.size:
            first_tokens = plan.query_start_loc[:-1]
            if not np.isin(placeholders, first_tokens).all():
                raise AssertionError("a placeholder that is not a sequence's first token")
            rows = plan.rows[np.searchsorted(first_tokens, placeholders)]
            if (self.last_sampled[rows] < 0).any():
                raise AssertionError("a placeholder for a row that did not sample last step")
        seqs = self.row_seq[plan.sample_rows]
        positions = plan.positions[plan.logits_indices] + 1
        sampled = fake_tokens(seqs, positions, self.vocab)
        ticket = getattr(plan, "grammar_mask", None)
        if ticket is not None:
            bits, _ = ticket.take(MASK_TIMEOUT_S)
            masked = plan.mask_sample_indices.astype(np.int64)
            sampled[masked] = allowed_pick(bits, self.vocab, seqs[masked], positions[masked], sampled[masked])
        self.last_sampled[:] = -1
        self.last_sampled[plan.sample_rows] = sampled
        self.steps += 1
        return sampled


@dataclass
class RunResult:
    """What a driven workload produced, by request id."""

    tokens: dict[str, list[list[int]]] = field(default_factory=dict)
    finish_reasons: dict[str, list[str]] = field(default_factory=dict)
    num_cached_tokens: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0
    steps: int = 0


def drive(
    sched: SchedulerThread,
    requests: Iterable[Request],
    executor: FakeExecutor | None = None,
    timeout: float = 60.0,
) -> RunResult:
    """Runs ``requests`` to completion through the scheduler thread, with the executor
    and the output side on two Python threads as in the engine."""
    from pyengine._sched import FINISH_REASONS

    executor = executor or FakeExecutor()
    result = RunResult()
    seq_owner: dict[int, tuple[str, int]] = {}
    expected = 0
    for req in requests:
        first = sched.add_request(req)
        result.tokens[req.request_id] = [[] for _ in range(req.n)]
        result.finish_reasons[req.request_id] = [""] * req.n
        for i in range(req.n):
            seq_owner[first + i] = (req.request_id, i)
        expected += req.n
    done = threading.Event()
    errors: list[BaseException] = []

    def execute() -> None:
        try:
            while not done.is_set():
                plan = sched.next_plan(timeout=0.05)
                if plan is not None:
                    sched.submit_result(plan.step_id, executor.run(plan))
                    result.steps += 1
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            errors.append(e)
            done.set()

    worker = threading.Thread(target=execute, name="fake-exec")
    worker.start()
    finished = 0
    try:
        while finished < expected and not done.is_set():
            ev = sched.next_output(timeout=timeout)
            if ev is None:
                raise TimeoutError(f"no output for {timeout}s; {finished}/{expected} finished")
            for seq, tok in zip(ev.seq_ids.tolist(), ev.token_ids.tolist()):
                rid, i = seq_owner[seq]
                result.tokens[rid][i].append(tok)
            for k, seq in enumerate(ev.finished_seq_ids.tolist()):
                rid, i = seq_owner[seq]
                result.finish_reasons[rid][i] = FINISH_REASONS[ev.finish_reasons[k]]
                if i == 0:
                    result.num_cached_tokens[rid] = int(ev.num_cached_tokens[k])
                result.num_preemptions += int(ev.num_preemptions[k])
                finished += 1
    finally:
        done.set()
        worker.join()
    if errors:
        raise errors[0]
    return result
