"""bad_words: a word's token sequence must not appear in the output (vLLM semantics).

For each of a request's words (token sequences, see ``bad_words_tokens``), the word's
last token is forbidden in a step when the request's outputs so far end with the word's
other tokens (a one-token word is always forbidden). Only output tokens count, not the
prompt. The processor keeps each index's last ``width`` outputs in a device tensor,
updated with every step's samples, and tests all (index, word) pairs at once.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from pyengine.logits_processors.index_state import move_rows, update_entries
from pyengine.logits_processors.interface import BatchUpdate, LogitsProcessor

_NO_TOKEN = -1  # a tail position before the first output
_ANY = -2  # a prefix position a shorter word does not use


class BadWordsLogitsProcessor(LogitsProcessor):
    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        self.words: dict[int, list[list[int]]] = {}
        self.tail = torch.full((int(config.max_num_seqs), 0), _NO_TOKEN, dtype=torch.int64, device=device)
        self._cached: Optional[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = None

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        if batch_update is None:
            return
        changed = update_entries(self.words, batch_update, lambda params, _p, _o: params._bad_words_token_ids or None)
        if not changed:
            return
        self._cached = None
        width = max((len(w) - 1 for words in self.words.values() for w in words), default=0)
        if width > self.tail.shape[1]:
            pad = self.tail.new_full((self.tail.shape[0], width - self.tail.shape[1]), _NO_TOKEN)
            self.tail = torch.cat([pad, self.tail], dim=1)
        for index, params, _prompt, outputs in batch_update.added:  # removed, added, then moved
            if params._bad_words_token_ids and self.tail.shape[1]:
                self._write_tail(index, outputs)
        move_rows(batch_update, self.tail)

    def _write_tail(self, index: int, outputs: list[int]) -> None:
        width = self.tail.shape[1]
        recent = outputs[-width:]
        row = [_NO_TOKEN] * (width - len(recent)) + list(recent)
        self.tail[index] = torch.tensor(row, dtype=torch.int64, device=self.device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.words:
            return logits
        n = logits.shape[0]
        if self._cached is None or self._cached[0] != n:
            self._cached = (n, *self._pairs(n, logits.device))
        _, index, prefix, last = self._cached
        if index.numel() == 0:
            return logits
        width = prefix.shape[1]
        recent = self.tail[index, self.tail.shape[1] - width:] if width else prefix
        matched = ((recent == prefix) | (prefix == _ANY)).all(dim=1)
        # Added, not written: pairs may share (index, token), and -inf + 0 stays -inf.
        penalty = torch.where(matched, float("-inf"), 0.0).to(logits.dtype)
        logits.index_put_((index, last), penalty, accumulate=True)
        return logits

    def _pairs(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pairs = [(i, w) for i, words in self.words.items() if i < n for w in words]
        width = max((len(w) - 1 for _, w in pairs), default=0)
        prefix = np.full((len(pairs), width), _ANY, dtype=np.int64)
        for k, (_, word) in enumerate(pairs):  # once per batch change, not per step
            if len(word) > 1:
                prefix[k, width - (len(word) - 1):] = word[:-1]
        index = torch.tensor([i for i, _ in pairs], dtype=torch.int64, device=device)
        last = torch.tensor([w[-1] for _, w in pairs], dtype=torch.int64, device=device)
        return index, torch.from_numpy(prefix).to(device), last

    def record_sampled(self, token_ids: torch.Tensor) -> None:
        if not self.words or self.tail.shape[1] == 0:
            return
        n = len(token_ids)
        self.tail[:n] = torch.cat([self.tail[:n, 1:], token_ids.view(-1, 1).to(torch.int64)], dim=1)

