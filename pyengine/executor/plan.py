"""The step plan the executor consumes (fields and meaning: docs/contract.md).

The Rust scheduler hands over an object with these attributes as numpy arrays (and
``new_params``, the new sequences' parameters, as a list); the executor only reads
attributes, so any object with the same names works. :class:`HandBuiltPlan` is the
pure-Python twin used by tests and benchmarks. The native class's ``FIELDS`` is the one
list of names: tests check these classes, the stub and the contract document against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import numpy as np

PLACEHOLDER_TOKEN = -1
"""In ``input_ids``: "the token sampled for this row in the previous step"."""


class StepPlanLike(Protocol):
    """The attributes the executor reads from a plan."""

    step_id: int
    rows: np.ndarray
    num_scheduled_tokens: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    logits_indices: np.ndarray
    sample_rows: np.ndarray
    pool_indices: np.ndarray
    block_table_rows: np.ndarray
    block_table_cols: np.ndarray
    block_table_ids: np.ndarray
    new_rows: np.ndarray
    new_seq_ids: np.ndarray
    new_num_prompt_tokens: np.ndarray
    new_token_offsets: np.ndarray
    new_token_ids: np.ndarray
    new_params: list[Any]
    freed_rows: np.ndarray
    mask_sample_indices: np.ndarray
    grammar_mask: Optional[Any]
    num_draft_tokens: np.ndarray
    draft_token_ids: np.ndarray
    propose_indices: Optional[np.ndarray]
    propose_counts: Optional[np.ndarray]
    block_table_groups: np.ndarray
    group_slot_mapping: np.ndarray
    may_draft_indices: Optional[np.ndarray]


@dataclass
class HandBuiltPlan:
    """A plan built in Python (same fields, dtypes and meaning as the scheduler's; no
    grammar masks unless given)."""

    step_id: int
    rows: np.ndarray
    num_scheduled_tokens: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    logits_indices: np.ndarray
    sample_rows: np.ndarray
    pool_indices: np.ndarray
    block_table_rows: np.ndarray
    block_table_cols: np.ndarray
    block_table_ids: np.ndarray
    new_rows: np.ndarray
    new_seq_ids: np.ndarray
    new_num_prompt_tokens: np.ndarray
    new_token_offsets: np.ndarray
    new_token_ids: np.ndarray
    new_params: list[Any]
    freed_rows: np.ndarray
    mask_sample_indices: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    grammar_mask: Optional[Any] = None
    #: [S] drafts per sampled sequence (empty: no drafts in the step), and the drafts.
    num_draft_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    draft_token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    #: [Q] sampled sequences (indices in sample order) the executor's draft model proposes
    #: for; None (hand-built plans only): every sampled sequence.
    propose_indices: Optional[np.ndarray] = None
    #: [Q] at most this many drafts for each of them; None (hand-built plans only): k.
    propose_counts: Optional[np.ndarray] = None
    #: [B] the table of each block-table write, and [T * (G - 1)] each token's slots in
    #: tables 1.. (a hybrid model's per-group tables); empty with one table.
    block_table_groups: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    group_slot_mapping: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    #: [V] indices into ``rows`` of the sequences that may still draft (an EAGLE-3 head
    #: keeps only their KV); None (hand-built plans only): every row.
    may_draft_indices: Optional[np.ndarray] = None


def last_sample_per_row(plan: StepPlanLike, sampled: np.ndarray,
                        num_accepted: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
    """Each sampled sequence's row and the last token it sampled in the step (what a
    placeholder in the next plan stands for). Without drafts that is ``sample_rows`` and
    ``sampled`` themselves; with drafts a sequence has ``1 + d`` entries and, in
    ``sampled``, its ``a`` accepted drafts and one more token: the last of those."""
    num_draft_tokens = getattr(plan, "num_draft_tokens", None)
    if num_draft_tokens is None or not len(num_draft_tokens):
        return plan.sample_rows, sampled
    last_entry = np.cumsum(np.asarray(num_draft_tokens, dtype=np.int64) + 1) - 1
    accepted = np.zeros(len(num_draft_tokens), dtype=np.int64) if num_accepted is None \
        else np.asarray(num_accepted, dtype=np.int64)
    last_token = np.cumsum(accepted + 1) - 1
    return np.asarray(plan.sample_rows)[last_entry], np.asarray(sampled)[last_token]
