"""Repetition, presence and frequency penalties over each row's token history.

Semantics (vLLM / OpenAI): the repetition penalty applies to every token seen in the
prompt or the output (positive logits divided by it, negative ones multiplied); presence
and frequency penalties apply to output tokens only (``logit -= presence * [count > 0]
+ frequency * count``).
"""

from __future__ import annotations

import numpy as np
import torch


class TokenHistory:
    """Per-row prompt-token presence and output-token counts ``[rows, vocab]``.

    Allocated on first use (only requests with penalties need it): the tables are
    ``rows * vocab`` large.
    """

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.prompt_mask = torch.zeros(max_rows, vocab_size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(max_rows, vocab_size, dtype=torch.int32, device=device)

    def reset_rows(self, rows: torch.Tensor) -> None:
        self.prompt_mask[rows] = False
        self.output_counts[rows] = 0

    def add_prompt_tokens(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """``rows`` and ``tokens`` are aligned 1-D tensors (one entry per token)."""
        self.prompt_mask[rows, tokens] = True

    def add_output_tokens(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        ones = torch.ones_like(tokens, dtype=torch.int32)
        self.output_counts.index_put_((rows, tokens), ones, accumulate=True)


def history_entries(rows: np.ndarray, offsets: np.ndarray, token_ids: np.ndarray, split: np.ndarray):
    """Expand new sequences' known tokens into (row, token, is_prompt) arrays.

    ``offsets`` [K+1] delimit each sequence's tokens in ``token_ids``; the first
    ``split[i]`` of sequence i are prompt tokens, the rest outputs (resumed sequences).
    """
    lengths = np.diff(offsets)
    token_rows = np.repeat(rows.astype(np.int64), lengths)
    index_in_sequence = np.arange(token_ids.size) - np.repeat(offsets[:-1], lengths)
    is_prompt = index_in_sequence < np.repeat(split, lengths)
    return token_rows, token_ids.astype(np.int64), is_prompt


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """Penalised copy of ``logits`` [S, vocab]; the other tensors are per sampled row."""
    seen = prompt_mask | (output_counts > 0)
    rep = repetition[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    counts = output_counts.to(logits.dtype)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)
