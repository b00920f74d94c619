"""Routing: which experts each token goes to, and with what weight.

A router turns a layer's input ``[T, hidden]`` into a :class:`Routing` (``[T, k]`` expert
ids and ``[T, k]`` float32 weights); the grouped experts (``experts.py``) take it from
there. Scoring rules differ by family (softmax over all experts then top-k here; other
families may score differently) but all produce the same :class:`Routing`, so the
expert products never depend on how the experts were chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pyengine.models.layers import WeightTarget


@dataclass(frozen=True, slots=True)
class Routing:
    """``expert_ids`` int64 [T, k] (distinct experts per token) and ``weights`` float32
    [T, k]: token t's output is ``sum_j weights[t, j] * expert_{expert_ids[t, j]}(x_t)``."""

    expert_ids: torch.Tensor
    weights: torch.Tensor


def softmax_top_k(logits: torch.Tensor, top_k: int, normalize: bool) -> Routing:
    """Softmax over all experts (in float32), the ``top_k`` largest, renormalised to sum
    to 1 when ``normalize`` (``norm_topk_prob``; Mixtral always)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(ids, weights)


class SoftmaxTopKRouter(torch.nn.Module):
    """The ``gate`` linear ``[num_experts, hidden]`` (replicated on every tensor-parallel
    rank: all ranks route alike) and :func:`softmax_top_k` over its logits."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, normalize: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(num_experts, hidden_size))
        self.top_k = top_k
        self.normalize = normalize

    def forward(self, x: torch.Tensor) -> Routing:
        return softmax_top_k(F.linear(x, self.weight), self.top_k, self.normalize)

    def weight_targets(self, name: str) -> dict[str, WeightTarget]:
        return {name: WeightTarget(self.weight, tuple(self.weight.shape))}
