"""EAGLE-3 drafts (``speculative_config={"method": "eagle3", "model": HEAD, ...}``).

The head (``models/eagle3.py``) reads, at each position ``p``, the embedding of the token
at ``p + 1`` beside a hidden state: for committed positions the target's own (its three
auxiliary layers' states, captured in the target's forward, through ``fc``), for the
proposal steps the head's previous output. It keeps a one-layer paged KV cache indexed by
the target's block tables, like the draft model's (a hybrid target's table 0, a full
table: the head's one layer attends to the whole context):

1. **Mirror.** After each step's verdict, the head writes the K/V of the step's tokens
   shifted by one (``Eagle3Head.write_kv``: nothing reads those positions' outputs): the
   pair (token at ``p + 1``, target state at ``p``) at position ``p``, for every ``p``
   whose next token is now known and committed. The state of a row's last committed
   position is kept (the *carry*, per persistent-batch row) until the next step brings the
   token after it; so the first pair of a step is (its first token, the carry). A drafted
   sequence's positions after its last accepted token are not mirrored (only accepted
   tokens' states are valid); the next step starts there. A chunk with no carry (a new
   sequence, a prefix-cache hit, a resumed preemption) skips its first pair: that
   position's head KV is the one the cache block holds, which for a shared block was
   written for another continuation. That only changes drafts, never outputs. A sequence
   that never drafts again (not in the plan's ``may_draft_indices``) has only its prompt
   mirrored (a prefix-cache hit may hand those blocks to one that drafts); a step with
   nothing to mirror captures no target state at all.
2. **Propose.** For each sampled sequence the plan names in ``propose_indices``: the token
   just emitted with the carry at the position before it, then k greedy steps, each on the
   previous one's draft and pre-norm output, into scratch blocks (``proposals``). Draft ids
   are mapped to the target's vocabulary through ``d2t``. A proposal of one step (k = 1,
   or the scheduler's one-draft learning tries) writes only the position before the
   emitted token, a committed one whose block the row holds, and the pair it writes there
   (the emitted token, the carry) is the one the next step's mirror writes over it (the
   same kernels; equal to float32 rounding, as a product over several rows may round
   differently from one row's): it goes to the row's own blocks, no scratch copy. Where
   that mirror does not come (the sequence finishes, or stops drafting past its prompt),
   the entry stays what the mirror would have written, to that rounding: drafts only.

Drafts are the head's argmax: point masses, so rejection sampling stays exact with ``q = 1``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from pyengine.executor.attention.selector import select_attention_backend
from pyengine.executor.kv_cache import KVCacheShape, PagedKVCache
from pyengine.executor.proposals import (
    Drafts,
    ProposerCacheSize,
    ScratchBlocks,
    StepTokens,
    draft_counts,
    kept_drafts,
    mirrors_any,
    note_prompts,
    proposal_starts,
    propose_named,
    rows_to_mirror,
)
from pyengine.models.eagle3 import Eagle3Head, load_eagle3_head
from pyengine.models.eagle3_config import read_eagle3_config
from pyengine.models.loader import LoadedModel


class Eagle3Proposer:
    """The EAGLE-3 head, its KV cache, the per-row carry and the proposal loop (module docstring)."""

    def __init__(self, head: Eagle3Head, target: LoadedModel, k: int, block_size: int,
                 max_rows: int, max_model_len: int, attention_backend: str,
                 target_embedding: Optional[torch.Tensor] = None) -> None:
        """``target_embedding``: the target's whole embedding matrix, for a head without one
        of its own at tensor_parallel_size > 1 (the target's is split over the ranks and
        looking a token up in it is a collective; ``vocab_parallel.whole_embedding``)."""
        self.head, self.k, self.device = head, k, target.device
        self.block_size, self.max_model_len, self.max_rows = block_size, max_model_len, max_rows
        self.aux_layers = head.config.aux_layer_ids
        self.embed: Callable[[torch.Tensor], torch.Tensor] = _embedding(head, target, target_embedding)
        layer = head.config.layer
        shape = KVCacheShape(num_layers=1, num_kv_heads=head.num_kv_heads, head_dim=layer.head_dim,
                             block_size=block_size, dtype=target.dtype)
        self.cache_size = ProposerCacheSize.of(shape, max_rows, k)  # counted by the KV sizing
        self.backend = select_attention_backend(attention_backend, self.device, target.dtype)
        # Each row's last committed position: the head's input state there, which sequence, where.
        self.carry = torch.zeros(max_rows, layer.hidden_size, dtype=target.dtype, device=self.device)
        self.carry_seq = np.full(max_rows, -1, dtype=np.int64)
        self.carry_position = np.full(max_rows, -1, dtype=np.int64)
        self.prompt_len = np.zeros(max_rows, dtype=np.int64)  # each row's sequence's prompt

    def allocate(self, num_blocks: int) -> None:
        """The head's cache, once the pool's ``num_blocks`` are decided: as many, plus scratch."""
        self.scratch = ScratchBlocks(num_blocks, self.max_rows, self.k, self.block_size, self.max_model_len,
                                     self.device)
        self.kv_cache = PagedKVCache(self.cache_size.shape, self.scratch.total_blocks, self.device)

    @classmethod
    def load(cls, spec: Any, target: LoadedModel, config: Any, block_size: int, max_model_len: int,
             target_embedding: Optional[torch.Tensor] = None) -> "Eagle3Proposer":
        """The head on the target's device (at tensor_parallel_size > 1: rank 0 only); its
        cache comes with :meth:`allocate`."""
        folder = Path(spec.model)
        head_config = read_eagle3_config(folder, target.config)
        head = load_eagle3_head(folder, head_config, target.dtype, target.device, max_model_len)
        return cls(head, target, spec.num_speculative_tokens, block_size, config.max_num_seqs,
                   max_model_len, config.attention_backend, target_embedding)

    @property
    def kv_groups(self) -> list[tuple[Optional[int], int]]:
        """The head's one full-attention layer, which reads the target's block tables."""
        return [(None, 1)]

    def begin_step(self, plan: Any) -> bool:
        """Notes the plan's new rows' prompt lengths; returns whether the target must
        capture its auxiliary hidden states this step: some sequence may still draft
        (``may_draft_indices``; a hand-built plan without the field: every row), or some
        row's pairs fall in its prompt (mirrored for every sequence: a prefix-cache hit may
        reuse those blocks for one that drafts)."""
        note_prompts(plan, self.prompt_len)
        return mirrors_any(plan, self.prompt_len, shift=1)

    def after_step(self, step: StepTokens, output: Any, batch: Any) -> Optional[Drafts]:
        """Mirrors the step's committed tokens into the head's cache (for the sequences that
        may still draft), then proposes the next step's drafts (``batch``: the runner's
        persistent batch: block tables, seq ids)."""
        plan = step.plan
        if step.aux_hidden is None:  # nothing to mirror, no sequence drafts again (begin_step)
            return None
        starts = proposal_starts(plan, output) if len(plan.logits_indices) else None
        features = self.head.combine(step.aux_hidden)
        last_valid = np.asarray(plan.query_start_loc, dtype=np.int64)[1:] - 1
        if starts is not None:  # a sampled sequence's last committed token: its last accepted entry
            tokens = np.asarray(plan.logits_indices, dtype=np.int64)[starts.last_entries]
            owners = np.searchsorted(plan.query_start_loc, tokens, side="right") - 1
            last_valid[owners] = tokens
        self._mirror(step, features, last_valid, rows_to_mirror(plan, self.prompt_len, shift=1), batch)
        self._keep_carry(plan, features, last_valid, batch)
        if starts is None:
            return None
        return propose_named(starts, self.device, lambda rows, last, positions, caps: self.propose(
            rows, last, positions, batch.block_tables[:1], caps))

    def _mirror(self, step: StepTokens, features: torch.Tensor, last_valid: np.ndarray, mirrored: np.ndarray,
                batch: Any) -> None:
        """The pairs (token at p + 1, state at p) whose token is committed, into the cache:
        every pair of the rows that may draft again and of the rows whose chunk starts in
        their prompt (``mirrored`` [R]: ``proposals.rows_to_mirror``; the draft model's
        rule, a chunk whole: a recomputed preemption's chunk holds outputs too)."""
        plan = step.plan
        qs = np.asarray(plan.query_start_loc, dtype=np.int64)
        rows = np.asarray(plan.rows, dtype=np.int64)
        positions = np.asarray(plan.positions, dtype=np.int64)
        counts = np.diff(qs)
        owner = np.repeat(np.arange(len(rows)), counts)
        t = np.arange(len(positions), dtype=np.int64)
        first = t == qs[owner]
        carry_ok = ((self.carry_seq[rows] == batch.seq_ids[rows]) & (self.carry_position[rows] == positions[qs[:-1]] - 1)
                    & (positions[qs[:-1]] > 0))
        wanted = mirrored[owner]
        keep = wanted & (t <= last_valid[owner]) & (~first | carry_ok[owner])
        if not keep.any():
            return
        kept = t[keep]
        kept_owner = owner[keep]
        device = self.device
        prev = torch.from_numpy(np.maximum(kept - 1, 0)).to(device)
        hidden = features.index_select(0, prev)
        from_carry = np.flatnonzero(first[keep])
        if from_carry.size:
            hidden[torch.from_numpy(from_carry).to(device)] = self.carry[
                torch.from_numpy(rows[kept_owner[from_carry]]).to(device)]
        head_positions = positions[kept] - 1
        bs = self.block_size
        table_rows = torch.from_numpy(rows[kept_owner]).to(device)
        blocks = batch.block_table[table_rows, torch.from_numpy(head_positions // bs).to(device)].to(torch.int64)
        pos_t = torch.from_numpy(head_positions).to(device)
        embeds = self.embed(step.input_ids.index_select(0, torch.from_numpy(kept).to(device)))
        keys, values = self.kv_cache.layer_slots(0)
        self.head.write_kv(embeds, hidden, pos_t, keys, values, blocks * bs + pos_t % bs)

    def _keep_carry(self, plan: Any, features: torch.Tensor, last_valid: np.ndarray, batch: Any) -> None:
        """Each scheduled row's state at its last committed position, for the next step."""
        rows = np.asarray(plan.rows, dtype=np.int64)
        last = last_valid
        device = self.device
        self.carry[torch.from_numpy(rows).to(device)] = features.index_select(0, torch.from_numpy(last).to(device))
        self.carry_seq[rows] = batch.seq_ids[rows]
        self.carry_position[rows] = np.asarray(plan.positions, dtype=np.int64)[last]

    def propose(self, rows: np.ndarray, last_tokens: torch.Tensor, positions: np.ndarray,
                block_tables: torch.Tensor, caps: Optional[np.ndarray] = None) -> Drafts:
        """k drafts for each row (fewer near max_model_len, at most ``caps``): ``last_tokens`` [S] the tokens
        just emitted, at ``positions`` [S]; the head's first step sits one position before
        (its state there is the row's carry); ``block_tables``: [1, rows, blocks], the
        target's table 0 (a hybrid target's full table). Returns (counts int32 [S], tokens int64)."""
        positions = positions.astype(np.int64)
        counts = draft_counts(positions, self.k, self.max_model_len, caps)
        steps = int(counts.max()) if len(rows) else 0
        if steps == 0:
            return counts, np.zeros(0, dtype=np.int64)
        first = positions - 1
        if steps == 1:  # its one write: the pair the next step's mirror writes (module docstring)
            table = self.scratch.own_table(rows, first, block_tables)
        else:
            table = self.scratch.table(self.kv_cache, rows, first, steps, block_tables)
        hidden = self.carry[torch.from_numpy(rows).to(self.device)]
        tokens = last_tokens.to(torch.int64)
        drafts = []
        for j in range(steps):
            pos_t, layout = self.scratch.step_layout(table, first + j)
            out, hidden = self.head(self.embed(tokens), hidden, pos_t, self.backend.bind(self.kv_cache, layout))
            tokens = self.head.draft_tokens(out)
            drafts.append(tokens)
        return counts, kept_drafts(drafts, counts)


def _embedding(head: Eagle3Head, target: LoadedModel,
               whole: Optional[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The head's token embedding: its own, else the target's (``whole``: the target's
    matrix gathered on this rank, when the target's module holds only a slice)."""
    if head.embed_tokens is not None:
        return head.embed_tokens
    if target.model.parallel.world_size == 1:
        return target.model.embed_tokens
    if whole is None:
        raise ValueError("an EAGLE-3 head sharing a split target's embedding needs the whole matrix")
    return lambda ids: F.embedding(ids, whole)
