"""The draft model (``speculative_config={"method": "draft_model", "model": ...}``).

A second, smaller checkpoint sharing the target's vocabulary, loaded through the same
loader, with its own KV cache indexed by the target's block tables and slot mapping:

1. every step, after the target's, the draft runs over the same tokens at the same
   positions and slots, so its cache mirrors the target's (the KV of drafts the target
   rejects is garbage in both, overwritten by the next step);
2. then, for each sampled sequence the plan names in ``propose_indices`` (those that may
   draft and have room for one: not constrained, pooling, turned off by the adaptive rule
   or refused by the executor, nor at their last token), it proposes k tokens greedily,
   one forward per draft, starting from the token just emitted. Those positions' blocks may not be allocated
   yet (the scheduler reserves them when it plans the next step), so the proposal
   forwards write into scratch blocks of the draft's own cache: each row's block that
   holds the first proposal position is copied into the row's scratch blocks and the
   row's table points there from that block on, so the real cache is never touched.

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
from pyengine.executor.kv_cache import KVCacheShape, PagedKVCache
from pyengine.models.loader import LoadedModel, load_model


class DraftProposer:
    """The draft model, its KV cache and the proposal loop (module docstring)."""

    def __init__(self, loaded: LoadedModel, target: LoadedModel, k: int, num_blocks: int, block_size: int,
                 max_rows: int, max_model_len: int, attention_backend: str) -> None:
        check_same_vocabulary(loaded, target)
        if loaded.config.mla is not None:
            raise InvalidConfigError("speculative_config: a draft model with latent attention (DeepSeek MLA) is not "
                                     "supported yet")
        self.loaded, self.model, self.k = loaded, loaded.model, k
        self.model.pack_for_cpu()
        self.device, self.block_size, self.max_model_len = loaded.device, block_size, max_model_len
        self.num_blocks = num_blocks
        self.scratch_per_row = -(-(k + block_size) // block_size) + 1
        shape = KVCacheShape(num_layers=loaded.config.num_hidden_layers, num_kv_heads=self.model.num_kv_heads,
                             head_dim=loaded.config.head_dim, block_size=block_size, dtype=loaded.dtype)
        self.kv_cache = PagedKVCache(shape, num_blocks + max_rows * self.scratch_per_row, self.device)
        self.backend = select_attention_backend(attention_backend, self.device, loaded.dtype)

    @classmethod
    def load(cls, spec: Any, target: LoadedModel, config: Any, num_blocks: int, block_size: int,
             max_model_len: int) -> "DraftProposer":
        loaded = load_model(spec.model, dtype=config.dtype, device=config.device, load_format=config.load_format,
                            seed=config.seed + 1)
        return cls(loaded, target, spec.num_speculative_tokens, num_blocks, block_size, config.max_num_seqs,
                   max_model_len, config.attention_backend)

    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: StepAttentionLayout) -> None:
        """The step's tokens through the draft, writing its KV where the target wrote its own."""
        self.model(input_ids, positions, self.backend.bind(self.kv_cache, layout))

    def propose_after(self, plan: Any, output: Any, block_table: torch.Tensor) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """The next step's drafts for the sequences ``plan`` sampled (counts for all, in
        sample order), from the tokens ``output`` emitted (with drafts: each sequence's
        last one). Only those the plan names in ``propose_indices`` are proposed for (the
        scheduler's: they may draft and have room for one); a plan without the field (a
        hand-built one) means every sampled sequence."""
        if not len(plan.logits_indices):
            return None
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
        last = np.asarray(last, dtype=np.int64)
        wanted = getattr(plan, "propose_indices", None)
        if wanted is None:
            return self.propose(rows, torch.from_numpy(last).to(self.device), next_positions, block_table)
        wanted = np.asarray(wanted, dtype=np.int64)
        counts = np.zeros(len(rows), dtype=np.int32)
        if not len(wanted):
            return counts, np.zeros(0, dtype=np.int64)
        some, tokens = self.propose(rows[wanted], torch.from_numpy(last[wanted]).to(self.device),
                                    next_positions[wanted], block_table)
        counts[wanted] = some  # ascending indices: the tokens are in sample order already
        return counts, tokens

    def propose(self, rows: np.ndarray, last_tokens: torch.Tensor, positions: np.ndarray,
                block_table: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """k drafts for each row (fewer near max_model_len): ``last_tokens`` [S] the tokens
        just emitted, at ``positions`` [S]; returns (counts int32 [S], tokens int64)."""
        S, bs, device = len(rows), self.block_size, self.device
        positions = positions.astype(np.int64)
        counts = np.clip(self.max_model_len - 1 - positions, 0, self.k).astype(np.int32)
        steps = int(counts.max()) if S else 0
        if steps == 0:
            return counts, np.zeros(0, dtype=np.int64)
        last = self.max_model_len - 1  # rows with fewer drafts run at a clamped position, discarded
        first_block = np.minimum(positions, last) // bs
        width = int((np.minimum(positions + steps, last) // bs).max()) + 1
        table = torch.zeros(S, width, dtype=torch.int64, device=device)
        real_width = min(width, block_table.shape[1])
        table[:, :real_width] = block_table.index_select(0, torch.from_numpy(rows.astype(np.int64)).to(device))[
            :, :real_width].to(torch.int64)
        scratch = self.num_blocks + rows.astype(np.int64)[:, None] * self.scratch_per_row + np.arange(
            self.scratch_per_row)[None, :]
        for s in range(S):  # the row's table from its first proposal block on: its scratch blocks
            b0 = int(first_block[s])
            span = min(self.scratch_per_row, width - b0)
            source = int(table[s, b0])
            table[s, b0:b0 + span] = torch.from_numpy(scratch[s, :span]).to(device)
            self.kv_cache.keys[:, scratch[s, 0]] = self.kv_cache.keys[:, source]
            self.kv_cache.values[:, scratch[s, 0]] = self.kv_cache.values[:, source]
        tokens = last_tokens.to(torch.int64)
        drafts = []
        for j in range(steps):
            pos = np.minimum(positions + j, last)
            pos_t = torch.from_numpy(pos).to(device)
            slots = table.gather(1, torch.from_numpy(pos // bs).to(device).unsqueeze(1)).squeeze(1) * bs + pos_t % bs
            layout = StepAttentionLayout(
                query_start_loc=np.arange(S + 1, dtype=np.int64), seq_lens=pos + 1,
                num_scheduled_tokens=np.ones(S, dtype=np.int64), slot_mapping=slots,
                block_tables=table[:, :int((pos // bs).max()) + 1].to(torch.int32), block_size=bs)
            hidden = self.model(tokens, pos_t, self.backend.bind(self.kv_cache, layout))
            tokens = self.model.compute_logits(hidden).argmax(dim=-1)
            drafts.append(tokens)
        proposed = torch.stack(drafts, dim=1).cpu().numpy()  # [S, steps]
        keep = np.arange(steps)[None, :] < counts[:, None]
        return counts, proposed[keep].astype(np.int64)


def check_same_vocabulary(draft: LoadedModel, target: LoadedModel) -> None:
    """The draft's token ids must mean the target's: same vocabulary size and, when both
    ship a tokenizer, the same token -> id map."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise InvalidConfigError(f"speculative_config: the draft model's vocabulary ({draft.config.vocab_size} "
                                 f"tokens) is not the target's ({target.config.vocab_size}): a draft model must share "
                                 "the target's vocabulary")
    if draft.tokenizer is not None and target.tokenizer is not None:
        if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise InvalidConfigError("speculative_config: the draft model's tokenizer maps tokens to other ids than "
                                     "the target's: a draft model must share the target's vocabulary")
