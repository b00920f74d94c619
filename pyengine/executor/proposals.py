"""What the executor's proposers (the draft model, EAGLE-3) share: where each sequence's
proposal starts, and the scratch blocks its proposal forwards write into.

- :func:`proposal_starts`: after a step, each sampled sequence's row, the token it just
  emitted (with drafts: its last one) and that token's position, which of them the plan
  names in ``propose_indices`` (the scheduler's: those that may draft and have room for
  one; a hand-built plan without the field means every sampled sequence) and how many
  drafts each can use (``propose_counts``, one per named sequence, else a ``ValueError``;
  k without it).
- :class:`ScratchBlocks`: the proposal positions' blocks may not be allocated yet (the
  scheduler reserves them when it plans the next step), so a proposer's cache has a few
  blocks per row past the pool. Before the proposal forwards, each row's block holding
  its first proposal position is copied into the row's scratch blocks and the row's table
  points there from that block on, so the real cache is never touched. With a hybrid
  target's per-group tables (``kv_tables.proposer_tables``) each table has scratch
  blocks of its own per row, copied from that table's block. A proposal that writes only
  committed positions (EAGLE-3's one-step proposals) reads the rows' own tables instead
  (``ScratchBlocks.own_table``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import numpy as np
import torch

from pyengine.executor.attention.metadata import StepAttentionLayout
from pyengine.executor.kv_cache import KVCacheShape, PagedKVCache

Drafts = tuple[np.ndarray, np.ndarray]  # (counts int32 [S], tokens int64 [sum])
# (rows, last tokens, their positions, at most this many drafts per row or None: k)
ProposeFn = Callable[[np.ndarray, torch.Tensor, np.ndarray, Optional[np.ndarray]], Drafts]


@dataclass(frozen=True)
class ProposerCacheSize:
    """What a proposer's own KV cache costs beside the target's (``memory_profile``): one
    block of ``shape`` per pool block (it mirrors the target's block ids), plus
    ``scratch_blocks`` past the pool."""

    shape: KVCacheShape
    scratch_blocks: int

    @classmethod
    def of(cls, shape: KVCacheShape, max_rows: int, k: int, num_tables: int = 1) -> "ProposerCacheSize":
        """``num_tables``: the target's per-group tables the proposer reads (scratch blocks
        per row for each)."""
        return cls(shape, max_rows * num_tables * ScratchBlocks.blocks_per_row(k, shape.block_size))


@dataclass(frozen=True)
class StepTokens:
    """What a proposer reads of the step the target just ran (the model runner's)."""

    plan: Any
    input_ids: torch.Tensor  # int64 [T], placeholders filled
    positions: torch.Tensor  # int64 [T]
    layout: StepAttentionLayout
    aux_hidden: Optional[torch.Tensor] = None  # [T, n * hidden]: EAGLE-3's auxiliary hidden states


@dataclass(frozen=True)
class ProposalStarts:
    """Per sampled sequence of a step, in sample order."""

    rows: np.ndarray  # int64 [S]: persistent-batch rows
    last_tokens: np.ndarray  # int64 [S]: the token just emitted (with drafts: the last one)
    next_positions: np.ndarray  # int64 [S]: that token's position
    last_entries: np.ndarray  # int64 [S]: the entry (logits row) it was drawn at
    wanted: Optional[np.ndarray]  # int64 [Q] ascending sample indices to propose for; None: all
    caps: Optional[np.ndarray]  # int64 [Q] at most this many drafts for each of them; None: k


def proposal_starts(plan: Any, output: Any) -> ProposalStarts:
    """Where each sampled sequence of ``plan`` goes on from, given what ``output`` emitted."""
    counts = getattr(plan, "num_draft_tokens", None)
    if output.num_accepted is not None and counts is not None and len(counts):
        starts = np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64) + 1)[:-1]])
        accepted = output.num_accepted.astype(np.int64)
        rows, last_entry = np.asarray(plan.sample_rows)[starts], starts + accepted
        last = output.sampled_token_ids[np.cumsum(accepted + 1) - 1]
    else:
        rows, last_entry = np.asarray(plan.sample_rows), np.arange(len(plan.logits_indices))
        last = output.sampled_token_ids
    next_positions = np.asarray(plan.positions)[np.asarray(plan.logits_indices)[last_entry]] + 1
    wanted = getattr(plan, "propose_indices", None)
    caps = getattr(plan, "propose_counts", None)
    if wanted is None:
        caps = None  # a hand-built plan without the field: every sequence, k drafts
    elif caps is not None and len(caps) != len(wanted):
        raise ValueError(f"a plan's propose_counts ({len(caps)}) must have one entry per propose_indices entry "
                         f"({len(wanted)})")
    return ProposalStarts(rows.astype(np.int64), np.asarray(last, dtype=np.int64), next_positions.astype(np.int64),
                          last_entry.astype(np.int64), None if wanted is None else np.asarray(wanted, dtype=np.int64),
                          None if caps is None else np.asarray(caps, dtype=np.int64))


def names_none(plan: Any) -> bool:
    """Whether ``plan`` asks its proposer for no drafts at all (``propose_indices`` empty;
    a hand-built plan without the field asks for every sampled sequence's): the proposer
    then hands back None, which the scheduler takes as no drafts for any sequence."""
    wanted = getattr(plan, "propose_indices", None)
    return wanted is not None and not len(wanted)


def propose_named(starts: ProposalStarts, device: torch.device, propose: ProposeFn) -> Drafts:
    """``propose(rows, last_tokens, next_positions, caps)`` for the sequences ``starts``
    names, as counts for every sampled sequence (0 for the others) and their tokens in order."""
    if starts.wanted is None:
        return propose(starts.rows, torch.from_numpy(starts.last_tokens).to(device), starts.next_positions, None)
    wanted = starts.wanted
    counts = np.zeros(len(starts.rows), dtype=np.int32)
    if not len(wanted):
        return counts, np.zeros(0, dtype=np.int64)
    some, tokens = propose(starts.rows[wanted], torch.from_numpy(starts.last_tokens[wanted]).to(device),
                           starts.next_positions[wanted], starts.caps)
    counts[wanted] = some  # ascending indices: the tokens are in sample order already
    return counts, tokens


class ScratchBlocks:
    """A few blocks per persistent-batch row (and block table read) past a proposer
    cache's ``num_blocks`` pool blocks, and the per-step tables and layouts of its
    proposal forwards."""

    def __init__(self, num_blocks: int, max_rows: int, k: int, block_size: int, max_model_len: int,
                 device: torch.device, num_tables: int = 1) -> None:
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, device
        self.num_tables = num_tables
        self.last_position = max_model_len - 1  # rows with fewer drafts run at a clamped position
        self.per_row = self.blocks_per_row(k, block_size)
        self.total_blocks = num_blocks + max_rows * num_tables * self.per_row

    @staticmethod
    def blocks_per_row(k: int, block_size: int) -> int:
        """Scratch blocks each row needs for k proposal positions (the copied first block included)."""
        return -(-(k + block_size) // block_size) + 1

    def table(self, cache: PagedKVCache, rows: np.ndarray, first_positions: np.ndarray, steps: int,
              block_tables: torch.Tensor) -> torch.Tensor:
        """The rows' tables [num_tables, S, width] for forwards at ``first_positions + 0 ..
        steps - 1`` (``block_tables``: the persistent batch's [num_tables, rows, blocks]):
        in each table the real blocks before each row's first proposal block, its scratch
        blocks from there on (the first one a copy of that table's real block, every
        cache tensor)."""
        bs, device = self.block_size, self.device
        S, tables = len(rows), block_tables.shape[0]
        first_block = np.minimum(first_positions, self.last_position) // bs
        width = int((np.minimum(first_positions + steps, self.last_position) // bs).max()) + 1
        table = torch.zeros(tables, S, width, dtype=torch.int64, device=device)
        real_width = min(width, block_tables.shape[2])
        table[:, :, :real_width] = block_tables.index_select(1, torch.from_numpy(rows.astype(np.int64)).to(device))[
            :, :, :real_width].to(torch.int64)
        # Each row's table from its first proposal block on: its scratch blocks (as many as
        # fit the width), the first one a copy of the real block there. Indexed all rows at
        # once: no per-row read of the table (a device sync per row on CUDA).
        columns = first_block[:, None] + np.arange(self.per_row)[None, :]
        fits = columns < width
        row_of = torch.from_numpy(np.broadcast_to(np.arange(S)[:, None], columns.shape)[fits]).to(device)
        column_of = torch.from_numpy(columns[fits]).to(device)
        first_t = torch.from_numpy(first_block.astype(np.int64)).to(device).unsqueeze(1)
        for t in range(tables):
            scratch = (self.num_blocks + (rows.astype(np.int64)[:, None] * self.num_tables + t) * self.per_row
                       + np.arange(self.per_row)[None, :])
            sources = table[t].gather(1, first_t).squeeze(1)
            table[t, row_of, column_of] = torch.from_numpy(scratch[fits]).to(device)
            targets = torch.from_numpy(scratch[:, 0]).to(device)
            cache.keys[:, targets] = cache.keys[:, sources]
            cache.values[:, targets] = cache.values[:, sources]
        return table

    def own_table(self, rows: np.ndarray, positions: np.ndarray, block_tables: torch.Tensor) -> torch.Tensor:
        """The rows' own tables [num_tables, S, width] up to the block of ``positions``, no
        scratch: for a proposal whose every write goes to a committed position of the row
        (its blocks allocated, and the entry the proposer's mirror writes there anyway)."""
        width = int((np.minimum(positions, self.last_position) // self.block_size).max()) + 1
        picked = block_tables.index_select(1, torch.from_numpy(rows.astype(np.int64)).to(self.device))
        return picked[:, :, :width].to(torch.int64)

    def step_layout(self, table: torch.Tensor, positions: np.ndarray) -> tuple[torch.Tensor, StepAttentionLayout]:
        """One token per row at ``positions`` (clamped to the model's last position): the
        positions on the device and the forward's attention layout over ``table``
        [num_tables, S, width] (tables 1.. in its ``group_layouts``)."""
        bs, device = self.block_size, self.device
        pos = np.minimum(positions, self.last_position)
        S = len(pos)
        pos_t = torch.from_numpy(pos).to(device)
        columns = torch.from_numpy(pos // bs).to(device).unsqueeze(1)
        width = int((pos // bs).max()) + 1
        layouts = [
            StepAttentionLayout(
                query_start_loc=np.arange(S + 1, dtype=np.int64), seq_lens=pos + 1,
                num_scheduled_tokens=np.ones(S, dtype=np.int64),
                slot_mapping=one.gather(1, columns).squeeze(1) * bs + pos_t % bs,
                block_tables=one[:, :width].to(torch.int32), block_size=bs)
            for one in table
        ]
        return pos_t, replace(layouts[0], group_layouts=tuple(layouts[1:]))


def rows_to_mirror(plan: Any, prompt_len: np.ndarray, shift: int = 0) -> np.ndarray:
    """Which of the plan's rows (bool [R]) a proposer with a cache of its own keeps up: the
    sequences that may draft again (``may_draft_indices``; a hand-built plan without the
    field: every row) and any row whose chunk starts in its prompt (``prompt_len`` per
    persistent-batch row: a prefix-cache hit may hand those blocks to one that drafts).
    ``shift``: the proposer's cache entry for a token at ``p`` sits at ``p - shift``
    (EAGLE-3's: 1), so a chunk "starts in its prompt" when ``first - shift < prompt_len``."""
    may_draft = getattr(plan, "may_draft_indices", None)
    if may_draft is None:
        return np.ones(len(plan.rows), dtype=bool)
    keep = np.zeros(len(plan.rows), dtype=bool)
    keep[np.asarray(may_draft, dtype=np.int64)] = True
    firsts = np.asarray(plan.positions, dtype=np.int64)[np.asarray(plan.query_start_loc, dtype=np.int64)[:-1]]
    return keep | (firsts - shift < prompt_len[np.asarray(plan.rows, dtype=np.int64)])


def mirrors_any(plan: Any, prompt_len: np.ndarray, shift: int = 0) -> bool:
    """Whether :func:`rows_to_mirror` names any row, in as few array operations as it takes
    (a proposer asks it every step, most of them after all its sequences stopped drafting):
    a sequence that may still draft settles it; else whether some row's chunk starts in
    its prompt (a decode-only step's positions are its rows' first ones)."""
    may_draft = getattr(plan, "may_draft_indices", None)
    rows = np.asarray(plan.rows, dtype=np.int64)
    if may_draft is None or len(may_draft):
        return len(rows) > 0
    positions = np.asarray(plan.positions, dtype=np.int64)
    firsts = positions if len(positions) == len(rows) else positions[np.asarray(plan.query_start_loc)[:-1]]
    return bool((firsts - shift < prompt_len[rows]).any())


def note_prompts(plan: Any, prompt_len: np.ndarray) -> None:
    """The plan's new rows' prompt lengths into ``prompt_len`` (per persistent-batch row)."""
    if len(plan.new_rows):
        prompt_len[np.asarray(plan.new_rows, dtype=np.int64)] = np.asarray(plan.new_num_prompt_tokens)


def select_rows(step: StepTokens, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, StepAttentionLayout]:
    """The step's tokens, positions and attention layout restricted to its rows ``rows``
    (ascending indices into ``plan.rows``), each row's chunk whole."""
    qs = np.asarray(step.plan.query_start_loc, dtype=np.int64)
    starts, counts = qs[rows], qs[rows + 1] - qs[rows]
    new_starts = np.concatenate([[0], np.cumsum(counts)])
    tokens = np.arange(int(new_starts[-1])) + np.repeat(starts - new_starts[:-1], counts)
    device = step.input_ids.device
    token_t, row_t = torch.from_numpy(tokens).to(device), torch.from_numpy(rows).to(device)

    def restricted(layout: StepAttentionLayout) -> StepAttentionLayout:
        return StepAttentionLayout(
            query_start_loc=new_starts, seq_lens=np.asarray(layout.seq_lens)[rows], num_scheduled_tokens=counts,
            slot_mapping=layout.slot_mapping.index_select(0, token_t),
            block_tables=layout.block_tables.index_select(0, row_t), block_size=layout.block_size)

    layout = step.layout
    sub = replace(restricted(layout), group_layouts=tuple(restricted(g) for g in layout.group_layouts))
    return step.input_ids.index_select(0, token_t), step.positions.index_select(0, token_t), sub


def draft_counts(next_positions: np.ndarray, k: int, max_model_len: int,
                 caps: Optional[np.ndarray] = None) -> np.ndarray:
    """Drafts to propose for each sequence (int32 [S]): k, fewer near ``max_model_len``,
    at most ``caps`` (the plan's ``propose_counts``) when given."""
    counts = np.clip(max_model_len - 1 - next_positions.astype(np.int64), 0, k)
    if caps is not None:
        counts = np.minimum(counts, caps)
    return counts.astype(np.int32)


def kept_drafts(proposed: list[torch.Tensor], counts: np.ndarray) -> np.ndarray:
    """The flat drafts (int64) of per-forward proposals [S] each, each row's first counts."""
    steps = len(proposed)
    table = torch.stack(proposed, dim=1).cpu().numpy()  # [S, steps]
    keep = np.arange(steps)[None, :] < counts[:, None]
    return table[keep].astype(np.int64)
