"""Applying a step's grammar mask to its logits, on the device, vectorised.

The scheduler thread computes the allowed-token bitmask of every constrained sample
(packed: bit ``t % 32`` of word ``t / 32``) while the step's forward pass runs. Just
before sampling the executor takes it (a bounded wait, GIL released), unpacks it on the
device (bytes -> shifts -> bools) and sets the disallowed logits of those rows to
``-inf`` (on CPU, float32 logits are masked in place by a native kernel, without the
unpacked temporary). No Python loop over sequences; rows without a grammar are not touched.

It also records, per step, how long the scheduler spent computing the mask and how long
the executor waited for it: the part of the computation that was not hidden behind the
forward pass.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np
import torch

from pyengine._kernels import apply_token_bitmask

#: How long the executor waits for a mask before failing the step (a scheduler stall).
MASK_TIMEOUT_S = 30.0


class GrammarMaskApplier:
    """Takes and applies grammar masks for one device; keeps a window of timings."""

    def __init__(self, device: torch.device, window: int = 4096) -> None:
        self.device = device
        self._shifts = torch.arange(8, dtype=torch.uint8, device=device)
        self._compute: deque[float] = deque(maxlen=window)
        self._wait: deque[float] = deque(maxlen=window)
        self._apply: deque[float] = deque(maxlen=window)
        self.steps = 0

    def apply(self, plan: Any, logits: torch.Tensor) -> torch.Tensor:
        """Masks ``logits`` (``[S, vocab]``, one row per sample) in place and returns it."""
        t0 = time.perf_counter()
        bits, compute_s = plan.grammar_mask.take(MASK_TIMEOUT_S)
        t1 = time.perf_counter()
        rows = plan.mask_sample_indices.astype(np.int64)
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
            apply_token_bitmask(logits.numpy(), np.ascontiguousarray(bits), rows)  # in place, one pass
        else:
            index = torch.from_numpy(rows).to(self.device)
            allowed = self.unpack(bits, logits.shape[-1])
            masked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
            logits.index_copy_(0, index, masked)
        self._compute.append(compute_s)
        self._wait.append(t1 - t0)
        self._apply.append(time.perf_counter() - t1)
        self.steps += 1
        return logits

    def unpack(self, bits: np.ndarray, vocab_size: int) -> torch.Tensor:
        """``[M, words]`` uint32 -> ``[M, vocab_size]`` bool on the device (tokens past the
        mask's width are disallowed)."""
        # Words are little-endian: token t is bit t % 8 of byte t // 8. Bytes keep the
        # unpacked temporary at one byte per token.
        data = torch.from_numpy(np.ascontiguousarray(bits, dtype="<u4").view(np.uint8)).to(self.device)
        allowed = ((data.unsqueeze(-1) >> self._shifts) & 1).bool().reshape(data.shape[0], -1)
        width = allowed.shape[1]
        if width >= vocab_size:
            return allowed[:, :vocab_size]
        return torch.nn.functional.pad(allowed, (0, vocab_size - width), value=False)

    def summary(self) -> dict[str, float]:
        """Per-step mask figures over the window: compute p50/p99 (scheduler thread), the
        executor's wait p50/p99 and apply p50 (ms), and the share of compute time hidden
        behind the forward pass (1 - waited / computed), and the executor's total apply
        and wait seconds."""
        compute, wait, apply = sorted(self._compute), sorted(self._wait), sorted(self._apply)
        if not compute:
            return {"steps": 0}
        exposed = sum(min(w, c) for w, c in zip(self._wait, self._compute))
        total = sum(compute)
        return {
            "steps": float(len(compute)),
            "compute_ms_p50": 1e3 * _quantile(compute, 0.5),
            "compute_ms_p99": 1e3 * _quantile(compute, 0.99),
            "wait_ms_p50": 1e3 * _quantile(wait, 0.5),
            "wait_ms_p99": 1e3 * _quantile(wait, 0.99),
            "apply_ms_p50": 1e3 * _quantile(apply, 0.5),
            "hidden_fraction": 1.0 - exposed / total if total > 0 else 1.0,
            "apply_s_total": sum(apply),
            "wait_s_total": sum(wait),
        }


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]
