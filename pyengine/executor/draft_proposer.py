"""The draft model (``speculative_config={"method": "draft_model", "model": ...}``).

A second, smaller checkpoint sharing the target's vocabulary, loaded through the same
loader, with its own KV cache indexed by the target's block tables and slot mapping:

1. every step, after the target's, the draft runs over the same tokens at the same
   positions and slots, so its cache mirrors the target's (the KV of drafts the target
   rejects is garbage in both, overwritten by the next step);
2. then, for each sampled sequence the plan names in ``propose_indices`` (those that may
   draft and have room for one: not constrained, pooling, turned off by the adaptive rule
   or refused by the executor, nor at their last token), it proposes k tokens greedily,
   one forward per draft, starting from the token just emitted, writing into scratch
   blocks of the draft's own cache (``proposals.ScratchBlocks``: the real cache is never
   touched).

With a hybrid target's per-group block tables each draft layer reads one of the target's
tables (``kv_tables.proposer_tables``: a windowed layer its window's, every other a full
one) and the draft's cache is laid out over them as the target's is; its attention is
bound per table (``attention/tables.py``).

Drafts are the draft's argmax for every row: a deterministic proposal is a point mass,
so rejection sampling (``rejection_sampler``) keeps sampled rows exact with ``q = 1``.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from pyengine.errors import InvalidConfigError
from pyengine.executor.attention.metadata import StepAttentionLayout
from pyengine.executor.attention.selector import select_attention_backend
from pyengine.executor.attention.tables import TableAttentionBackend
from pyengine.executor.kv_cache import KVCacheShape, PagedKVCache
from pyengine.executor.kv_tables import KVTables, proposer_tables
from pyengine.executor.proposals import (
    Drafts,
    ProposerCacheSize,
    ScratchBlocks,
    StepTokens,
    draft_counts,
    kept_drafts,
    names_none,
    note_prompts,
    proposal_starts,
    propose_named,
    rows_to_mirror,
    select_rows,
)
from pyengine.executor.proposer_config import check_draft_config
from pyengine.models.greedy import greedy_tokens
from pyengine.models.layer_config import kv_groups as layer_kv_groups
from pyengine.models.loader import LoadedModel, load_model


class DraftProposer:
    """The draft model, its KV cache and the proposal loop (module docstring)."""

    def __init__(self, loaded: LoadedModel, target: LoadedModel, k: int, block_size: int,
                 max_rows: int, max_model_len: int, attention_backend: str,
                 target_tables: Optional[KVTables] = None) -> None:
        check_same_vocabulary(loaded, target)
        self.loaded, self.model, self.k = loaded, loaded.model, k
        self.model.pack_for_cpu()
        self.device, self.block_size, self.max_model_len = loaded.device, block_size, max_model_len
        self.max_rows = max_rows
        self.prompt_len = np.zeros(max_rows, dtype=np.int64)  # each row's sequence's prompt
        config = loaded.config
        # The target's per-group tables each draft layer reads (None: one shared table).
        self.tables = None if target_tables is None else proposer_tables(
            target_tables, config.layer_windows, config.num_hidden_layers)
        self.num_tables = 1 if target_tables is None else target_tables.num_tables
        layers = config.num_hidden_layers if self.tables is None else self.tables.layers_per_table
        shape = KVCacheShape(num_layers=layers, num_kv_heads=self.model.num_kv_heads, head_dim=config.head_dim,
                             block_size=block_size, dtype=loaded.dtype)
        self.cache_size = ProposerCacheSize.of(shape, max_rows, k, self.num_tables)  # counted by the KV sizing
        backend = select_attention_backend(attention_backend, self.device, loaded.dtype)
        self.backend = backend if self.tables is None else TableAttentionBackend(backend, self.tables.table_of_layer)

    def allocate(self, num_blocks: int) -> None:
        """The draft's cache, once the pool's ``num_blocks`` are decided: as many, plus scratch."""
        self.scratch = ScratchBlocks(num_blocks, self.max_rows, self.k, self.block_size, self.max_model_len,
                                     self.device, self.num_tables)
        self.kv_cache = PagedKVCache(self.cache_size.shape, self.scratch.total_blocks, self.device, self.tables)

    @property
    def kv_groups(self) -> list[tuple[Optional[int], int]]:
        """The draft's layers, which read the target's block tables (``layer_config.kv_groups``)."""
        return layer_kv_groups(self.loaded.config.layer_windows, self.loaded.config.num_hidden_layers)

    @classmethod
    def load(cls, spec: Any, target: LoadedModel, config: Any, block_size: int,
             max_model_len: int, target_tables: Optional[KVTables] = None) -> "DraftProposer":
        """The draft, whole on this process's device (at tensor_parallel_size > 1 only rank 0
        loads it: it is never split); its cache comes with :meth:`allocate`; ``target_tables``:
        a hybrid target's per-group tables, which the draft's layers read."""
        loaded = load_model(spec.model, dtype=config.dtype, device=target.device, load_format=config.load_format,
                            seed=config.seed + 1)
        return cls(loaded, target, spec.num_speculative_tokens, block_size, config.max_num_seqs,
                   max_model_len, config.attention_backend, target_tables)

    def after_step(self, step: StepTokens, output: Any, batch: Any) -> Optional[Drafts]:
        """Mirrors the step into the draft's cache (the rows ``proposals.rows_to_mirror``
        keeps: not the outputs of sequences that never draft again), then proposes the
        next step's drafts (``batch``: the runner's persistent batch, for its block tables)."""
        note_prompts(step.plan, self.prompt_len)
        keep = rows_to_mirror(step.plan, self.prompt_len)
        if keep.all():
            self.mirror(step.input_ids, step.positions, step.layout)
        elif keep.any():
            self.mirror(*select_rows(step, np.flatnonzero(keep)))
        elif names_none(step.plan):  # no sequence of the step drafts again: nothing to do
            return None
        return self.propose_after(step.plan, output, batch.block_tables)

    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: StepAttentionLayout) -> None:
        """The step's tokens through the draft, writing its KV where the target wrote its own."""
        self.model(input_ids, positions, self.backend.bind(self.kv_cache, layout))

    def propose_after(self, plan: Any, output: Any, block_tables: torch.Tensor) -> Optional[Drafts]:
        """The next step's drafts for the sequences ``plan`` sampled (counts for all, in
        sample order), from the tokens ``output`` emitted (``proposals.proposal_starts``)."""
        if not len(plan.logits_indices):
            return None
        starts = proposal_starts(plan, output)
        return propose_named(starts, self.device, lambda rows, last, positions, caps: self.propose(
            rows, last, positions, block_tables, caps))

    def propose(self, rows: np.ndarray, last_tokens: torch.Tensor, positions: np.ndarray,
                block_tables: torch.Tensor, caps: Optional[np.ndarray] = None) -> Drafts:
        """k drafts for each row (fewer near max_model_len, at most ``caps``): ``last_tokens``
        [S] the tokens just emitted, at ``positions`` [S]; ``block_tables``: the persistent
        batch's [num_tables, rows, blocks]; returns (counts int32 [S], tokens int64)."""
        positions = positions.astype(np.int64)
        counts = draft_counts(positions, self.k, self.max_model_len, caps)
        steps = int(counts.max()) if len(rows) else 0
        if steps == 0:
            return counts, np.zeros(0, dtype=np.int64)
        table = self.scratch.table(self.kv_cache, rows, positions, steps, block_tables)
        tokens = last_tokens.to(torch.int64)
        drafts = []
        for j in range(steps):
            pos_t, layout = self.scratch.step_layout(table, positions + j)
            hidden = self.model(tokens, pos_t, self.backend.bind(self.kv_cache, layout))
            tokens = greedy_tokens(self.model.compute_logits(hidden))
            drafts.append(tokens)
        return counts, kept_drafts(drafts, counts)


def check_same_vocabulary(draft: LoadedModel, target: LoadedModel) -> None:
    """The draft's token ids must mean the target's: same vocabulary size and, when both
    ship a tokenizer, the same token -> id map (and no latent attention:
    ``proposer_config.check_draft_config``)."""
    check_draft_config(draft.config, target.config)
    if draft.tokenizer is not None and target.tokenizer is not None:
        if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise InvalidConfigError("speculative_config: the draft model's tokenizer maps tokens to other ids than "
                                     "the target's: a draft model must share the target's vocabulary")
