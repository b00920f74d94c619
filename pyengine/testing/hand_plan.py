"""Build valid step plans by hand: a toy scheduler for executor tests and benchmarks.

:class:`HandPlanner` keeps sequences, rows and blocks the way the Rust scheduler does and
emits :class:`~pyengine.executor.plan.HandBuiltPlan` objects that honour docs/contract.md:
chunked prefill, decode with placeholders, block tables written once per new block,
contiguous or randomly scattered block ids, pooling sequences, freed rows.

Typical loop (pipeline depth 1)::

    planner = HandPlanner(block_size=runner.block_size, num_blocks=runner.num_kv_blocks)
    planner.add(prompt_ids, SamplingParams(temperature=0))
    plan = planner.next_plan()
    out = runner.execute(plan)
    planner.record(plan, out.sampled_token_ids)

At depth 2, call ``next_plan`` again before ``record``: decodes of sequences that sampled
in the previous plan then carry the placeholder ``-1``.

A hybrid model's runner with per-group block tables (``runner.num_kv_tables > 1``) needs
``HandPlanner(tables=runner.num_kv_tables)``: every table gets its own blocks (kept, none
freed behind a window) and the plan its ``block_table_groups`` and ``group_slot_mapping``.

Speculative decoding (docs/speculative_decoding.md): ``next_plan(drafts={seq_id: [...]})``
schedules a decoding sequence's last token and its drafts (one logits entry each) and
``record(plan, sampled, num_accepted)`` keeps the accepted ones (depth 1 only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

from pyengine.executor.plan import PLACEHOLDER_TOKEN, HandBuiltPlan
from pyengine.sampling_params import PoolingParams, SamplingParams


def prefill_alone(runner: Any, prompt: list[int]) -> tuple[Any, Any]:
    """``prompt`` prefilled alone in one plan through ``runner`` (a
    :class:`~pyengine.executor.model_runner.ModelRunner`): (its step output, the logits at
    every prompt position)."""
    planner = HandPlanner(block_size=16, num_blocks=runner.num_kv_blocks, max_rows=8,
                          tables=getattr(runner, "num_kv_tables", 1))
    planner.add(prompt)
    out = runner.execute(planner.next_plan(), return_hidden=True)
    return out, runner.model.compute_logits(out.hidden_states)


class HandPlanError(RuntimeError):
    """The hand planner ran out of rows or blocks, or was given an unknown sequence."""


@dataclass
class _Sequence:
    seq_id: int
    tokens: list[Optional[int]]  # None: sampled, not recorded yet
    num_prompt: int
    pooling: bool
    params: Union[SamplingParams, PoolingParams, None] = None
    row: int = -1
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    extra_blocks: list[list[int]] = field(default_factory=list)  # tables 1.. (per-group tables)
    announced: bool = False  # sent in new_* already
    sampled_in_last_plan: bool = False
    drafted: int = 0  # drafts scheduled in the last plan, not recorded yet


class HandPlanner:
    """A minimal scheduler producing contract-valid plans (no preemption, no prefix cache)."""

    def __init__(
        self,
        *,
        block_size: int = 16,
        num_blocks: int = 1024,
        max_rows: int = 256,
        scatter_blocks: bool = True,
        use_placeholders: bool = True,
        seed: int = 0,
        tables: int = 1,
    ) -> None:
        self.block_size = block_size
        self.tables = tables
        self.max_rows = max_rows
        self.use_placeholders = use_placeholders
        blocks = np.arange(num_blocks)
        if scatter_blocks:
            blocks = np.random.default_rng(seed).permutation(num_blocks)
        self._free_blocks = [int(b) for b in blocks[::-1]]  # pop() from the end
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._sequences: dict[int, _Sequence] = {}
        self._freed_rows: list[int] = []
        self._next_seq_id = 1
        self._step_id = 0
        self.params: dict[int, Union[SamplingParams, PoolingParams]] = {}

    # ----- requests ---------------------------------------------------------------
    def add(self, prompt: list[int], params: Union[SamplingParams, PoolingParams, None] = None) -> int:
        """Queue a sequence; returns its seq id. It is scheduled by the next plan."""
        if not prompt:
            raise HandPlanError("prompt must not be empty")
        params = params if params is not None else SamplingParams(temperature=0.0)
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        self.params[seq_id] = params
        self._sequences[seq_id] = _Sequence(
            seq_id, list(prompt), len(prompt), isinstance(params, PoolingParams), params,
            extra_blocks=[[] for _ in range(self.tables - 1)],
        )
        return seq_id

    def finish(self, seq_id: int) -> None:
        """Release a sequence's row and blocks (reported as freed in the next plan)."""
        seq = self._sequences.pop(seq_id, None)
        if seq is None:
            raise HandPlanError(f"unknown sequence {seq_id}")
        if seq.row >= 0:
            self._freed_rows.append(seq.row)
            self._free_rows.append(seq.row)
        for table in (seq.blocks, *seq.extra_blocks):
            self._free_blocks.extend(reversed(table))

    def preempt(self, seq_id: int) -> None:
        """Preempt by recompute: free the row and blocks; the sequence re-enters later with
        all its known tokens (prompt, then outputs) as a new sequence of the batch."""
        seq = self._sequences.get(seq_id)
        if seq is None:
            raise HandPlanError(f"unknown sequence {seq_id}")
        if None in seq.tokens[:-1]:
            raise HandPlanError(f"sequence {seq_id}: record every step before preempting it")
        if seq.row >= 0:
            self._freed_rows.append(seq.row)
            self._free_rows.append(seq.row)
        for table in (seq.blocks, *seq.extra_blocks):
            self._free_blocks.extend(reversed(table))
        seq.tokens = [t for t in seq.tokens if t is not None]
        seq.row, seq.num_computed, seq.blocks = -1, 0, []
        seq.extra_blocks = [[] for _ in seq.extra_blocks]
        seq.announced, seq.sampled_in_last_plan = False, False

    def tokens(self, seq_id: int) -> list[int]:
        """Known tokens of a sequence (prompt, then recorded samples)."""
        return [t for t in self._sequences[seq_id].tokens if t is not None]

    def output_tokens(self, seq_id: int) -> list[int]:
        seq = self._sequences[seq_id]
        return [t for t in seq.tokens[seq.num_prompt :] if t is not None]

    def record(self, plan: HandBuiltPlan, sampled: np.ndarray, num_accepted: Optional[np.ndarray] = None) -> None:
        """Feed back the tokens the executor sampled for ``plan`` (with drafts: its
        ``num_accepted`` too, and ``sampled`` holds each sequence's kept drafts and one more)."""
        by_row = {seq.row: seq for seq in self._sequences.values()}
        if num_accepted is not None:
            self._record_drafted(plan, np.asarray(sampled).tolist(), np.asarray(num_accepted).tolist(), by_row)
            return
        for row, token in zip(plan.sample_rows.tolist(), np.asarray(sampled).tolist()):
            seq = by_row.get(row)
            if seq is None:
                continue  # finished meanwhile
            index = seq.tokens.index(None) if None in seq.tokens else None
            if index is not None:
                seq.tokens[index] = int(token)

    def _record_drafted(self, plan: Any, sampled: list[int], num_accepted: list[int], by_row: dict) -> None:
        rows = plan.sample_rows[np.concatenate([[0], np.cumsum(np.asarray(plan.num_draft_tokens) + 1)[:-1]])] \
            if len(plan.num_draft_tokens) else plan.sample_rows
        offset = 0
        for row, accepted in zip(rows.tolist(), num_accepted):
            run = sampled[offset:offset + accepted + 1]
            offset += accepted + 1
            seq = by_row.get(row)
            if seq is None:
                continue
            index = seq.tokens.index(None)
            seq.tokens[index:index + 1] = [int(t) for t in run]
            seq.num_computed -= seq.drafted - accepted  # the rejected drafts' KV is garbage
            seq.drafted = 0

    # ----- planning -----------------------------------------------------------------
    def next_plan(
        self, max_chunk: Optional[int] = None, max_tokens: Optional[int] = None,
        drafts: Optional[dict[int, list[int]]] = None,
    ) -> HandBuiltPlan:
        """Schedule live sequences in arrival order: decodes 1 token (plus its ``drafts``,
        by seq id), prefills up to ``max_chunk``, at most ``max_tokens`` tokens in all
        (the rest wait)."""
        builder = _PlanBuilder(self.block_size, self.tables)
        builder.drafts = drafts
        budget = max_tokens if max_tokens is not None else 1 << 62
        for seq in sorted(self._sequences.values(), key=lambda s: s.seq_id):
            if budget <= 0:
                break
            chunk = budget if max_chunk is None else min(max_chunk, budget)
            budget -= self._schedule(seq, builder, chunk, token_budget=budget)
        plan = builder.build(self._step_id, self._freed_rows)
        self._freed_rows = []
        self._step_id += 1
        for seq in self._sequences.values():
            seq.sampled_in_last_plan = seq.row in builder.sampled_rows
        for seq_id in builder.pooled_seq_ids:
            self.finish(seq_id)
        return plan

    def _schedule(self, seq: _Sequence, builder: "_PlanBuilder", max_chunk: int, token_budget: int) -> int:
        """Schedule part of ``seq``; returns the number of tokens scheduled."""
        remaining = len(seq.tokens) - seq.num_computed
        if remaining <= 0 or (seq.pooling and remaining > token_budget):
            return 0
        if seq.row < 0:
            if not self._free_rows:
                return 0  # no row free: waits
            seq.row = self._free_rows.pop()
        count = remaining if seq.pooling else min(remaining, max_chunk)
        drafts = (builder.drafts or {}).get(seq.seq_id, [])
        if drafts and (remaining != 1 or seq.num_computed < seq.num_prompt or seq.tokens[-1] is None):
            raise HandPlanError(f"sequence {seq.seq_id}: drafts need a decode whose last token is recorded")
        new_blocks = self._grow(seq, seq.num_computed + count + len(drafts))
        if not seq.announced:
            builder.add_new(seq)
            seq.announced = True
            new_blocks = list(range(len(seq.blocks)))
        start = seq.num_computed
        ids = []
        for index in range(start, start + count):
            token = seq.tokens[index]
            first_of_decode = index == start and start >= seq.num_prompt
            if token is None or (first_of_decode and self.use_placeholders and seq.sampled_in_last_plan
                                 and not drafts):
                if not (first_of_decode and seq.sampled_in_last_plan):
                    raise HandPlanError(
                        f"sequence {seq.seq_id}: token {index} unknown and not a valid placeholder"
                    )
                token = PLACEHOLDER_TOKEN
            ids.append(token)
        samples = start + count == len(seq.tokens) and not seq.pooling
        builder.add_scheduled(seq, ids + [int(t) for t in drafts], start, new_blocks, samples, len(drafts))
        seq.num_computed += count + len(drafts)
        seq.drafted = len(drafts)
        if samples:
            seq.tokens.append(None)
        return count + len(drafts)

    def _grow(self, seq: _Sequence, length: int) -> list[int]:
        needed = -(-length // self.block_size) - len(seq.blocks)
        if needed * self.tables > len(self._free_blocks):
            raise HandPlanError("out of KV blocks")
        first_new = len(seq.blocks)
        for table in (seq.blocks, *seq.extra_blocks):
            table.extend(self._free_blocks.pop() for _ in range(needed))
        return list(range(first_new, len(seq.blocks)))


class _PlanBuilder:
    def __init__(self, block_size: int, tables: int = 1) -> None:
        self.block_size = block_size
        self.tables = tables
        self.group_slots: list[int] = []
        self.rows: list[int] = []
        self.counts: list[int] = []
        self.seq_lens: list[int] = []
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.slots: list[int] = []
        self.logits_indices: list[int] = []
        self.sample_rows: list[int] = []
        self.sampled_rows: set[int] = set()
        self.pool_indices: list[int] = []
        self.pooled_seq_ids: list[int] = []
        self.table_writes: list[tuple[int, int, int]] = []
        self.new: list[_Sequence] = []
        self.new_tokens: list[list[int]] = []
        self.drafts: Optional[dict[int, list[int]]] = None
        self.num_draft_tokens: list[int] = []
        self.draft_token_ids: list[int] = []

    def add_new(self, seq: _Sequence) -> None:
        self.new.append(seq)
        self.new_tokens.append([t for t in seq.tokens if t is not None])

    def add_scheduled(
        self, seq: _Sequence, ids: list[int], start: int, new_blocks: list[int], samples: bool, num_drafts: int = 0
    ) -> None:
        index = len(self.rows)
        self.rows.append(seq.row)
        self.counts.append(len(ids))
        self.seq_lens.append(start + len(ids))
        for offset, token in enumerate(ids):
            position = start + offset
            self.input_ids.append(token)
            self.positions.append(position)
            self.slots.append(
                seq.blocks[position // self.block_size] * self.block_size + position % self.block_size
            )
            self.group_slots.extend(
                table[position // self.block_size] * self.block_size + position % self.block_size
                for table in seq.extra_blocks
            )
        for t, table in enumerate((seq.blocks, *seq.extra_blocks)):
            self.table_writes.extend((seq.row, col, table[col], t) for col in new_blocks)
        if samples:
            last = len(self.input_ids) - 1
            self.logits_indices.extend(range(last - num_drafts, last + 1))
            self.sample_rows.extend([seq.row] * (num_drafts + 1))
            self.sampled_rows.add(seq.row)
            self.num_draft_tokens.append(num_drafts)
            self.draft_token_ids.extend(ids[len(ids) - num_drafts:])
        if seq.pooling:
            self.pool_indices.append(index)
            self.pooled_seq_ids.append(seq.seq_id)

    def build(self, step_id: int, freed_rows: list[int]) -> HandBuiltPlan:
        i32, i64 = np.int32, np.int64
        lengths = [len(t) for t in self.new_tokens]
        writes = np.array(self.table_writes, dtype=i32).reshape(-1, 4)
        speculative: dict[str, Any] = {}
        if self.drafts is not None:
            has = any(self.num_draft_tokens)
            speculative = dict(num_draft_tokens=np.array(self.num_draft_tokens if has else [], dtype=i32),
                               draft_token_ids=np.array(self.draft_token_ids, dtype=i64))
        tables: dict[str, Any] = {}
        if self.tables > 1:
            tables = dict(block_table_groups=writes[:, 3].copy(), group_slot_mapping=np.array(self.group_slots, dtype=i64))
        return HandBuiltPlan(
            **speculative,
            **tables,
            step_id=step_id,
            rows=np.array(self.rows, dtype=i32),
            num_scheduled_tokens=np.array(self.counts, dtype=i32),
            query_start_loc=np.concatenate([[0], np.cumsum(self.counts)]).astype(i32),
            seq_lens=np.array(self.seq_lens, dtype=i32),
            input_ids=np.array(self.input_ids, dtype=i64),
            positions=np.array(self.positions, dtype=i64),
            slot_mapping=np.array(self.slots, dtype=i64),
            logits_indices=np.array(self.logits_indices, dtype=i64),
            sample_rows=np.array(self.sample_rows, dtype=i32),
            pool_indices=np.array(self.pool_indices, dtype=i32),
            block_table_rows=writes[:, 0].copy(),
            block_table_cols=writes[:, 1].copy(),
            block_table_ids=writes[:, 2].copy(),
            new_rows=np.array([s.row for s in self.new], dtype=i32),
            new_seq_ids=np.array([s.seq_id for s in self.new], dtype=np.uint64),
            new_num_prompt_tokens=np.array([s.num_prompt for s in self.new], dtype=i32),
            new_token_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(i64),
            new_token_ids=np.array([t for tokens in self.new_tokens for t in tokens], dtype=i64),
            new_params=[s.params for s in self.new],
            freed_rows=np.array(freed_rows, dtype=i32),
        )
