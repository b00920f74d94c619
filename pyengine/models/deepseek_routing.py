"""DeepSeek's expert routing: which ``num_experts_per_tok`` experts each token goes to,
and their weights, under the three rules the V2 / V3 configs name.

- ``softmax`` + ``greedy`` (V2-Lite): softmax over all experts, the k best.
- ``softmax`` + ``group_limited_greedy`` (V2): experts in ``n_group`` groups, each
  group scored by its best expert; only the ``topk_group`` best groups compete.
- ``sigmoid`` + ``noaux_tc`` (V3): sigmoid scores; the choice adds
  ``e_score_correction_bias`` (the load-balancing bias learnt without an auxiliary
  loss), a group scores as the sum of its two best biased experts, and the weights are
  the unbiased scores, renormalised when ``norm_topk_prob``.

The weights are then multiplied by ``routed_scaling_factor``. Scores are computed in
float32 from a float32 gate, as the reference implementations keep the gate.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pyengine.models.deepseek_config import DeepseekMoeConfig
from pyengine.models.layers import WeightTarget
from pyengine.models.router import Routing


def deepseek_route(
    logits: torch.Tensor, moe: DeepseekMoeConfig, correction_bias: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, experts]`` -> (expert ids int64 ``[T, k]``, float32 weights ``[T, k]``)."""
    logits = logits.float()
    k = moe.num_experts_per_tok
    if moe.scoring_func == "sigmoid":
        scores = logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
        choice = _keep_best_groups(choice, moe, lambda grouped: grouped.topk(2, dim=-1).values.sum(dim=-1))
        ids = choice.topk(k, dim=-1).indices
        weights = scores.gather(1, ids)
    else:
        scores = logits.softmax(dim=-1)
        if moe.topk_method == "group_limited_greedy":
            scores = _keep_best_groups(scores, moe, lambda grouped: grouped.amax(dim=-1), dropped=0.0)
        weights, ids = scores.topk(k, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * moe.routed_scaling_factor


def _keep_best_groups(scores, moe: DeepseekMoeConfig, group_score, dropped: float = float("-inf")) -> torch.Tensor:
    """``scores`` with every expert outside each token's ``topk_group`` best groups set to ``dropped``."""
    if moe.topk_group >= moe.n_group:
        return scores
    tokens = scores.shape[0]
    grouped = scores.view(tokens, moe.n_group, moe.n_routed_experts // moe.n_group)
    best = group_score(grouped).topk(moe.topk_group, dim=-1).indices
    keep = torch.zeros(tokens, moe.n_group, dtype=torch.bool, device=scores.device).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), dropped).view(tokens, -1)


class DeepseekRouter(torch.nn.Module):
    """The ``gate`` of a DeepSeek MoE layer: ``weight`` ``[experts, hidden]`` and, under
    ``noaux_tc``, ``e_score_correction_bias`` ``[experts]`` (replicated on every
    tensor-parallel rank, so all ranks route alike)."""

    def __init__(self, hidden_size: int, moe: DeepseekMoeConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = torch.nn.Parameter(torch.empty(moe.n_routed_experts, hidden_size))
        self.e_score_correction_bias = (
            torch.nn.Parameter(torch.empty(moe.n_routed_experts)) if moe.topk_method == "noaux_tc" else None
        )

    def forward(self, x: torch.Tensor) -> Routing:
        """The experts and weights of every token of ``x`` ``[T, hidden]``."""
        logits = F.linear(x.float(), self.weight.float())
        ids, weights = deepseek_route(logits, self.moe, self.e_score_correction_bias)
        return Routing(ids, weights)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets = {f"{prefix}.weight": WeightTarget(self.weight, tuple(self.weight.shape))}
        if self.e_score_correction_bias is not None:
            bias = self.e_score_correction_bias
            targets[f"{prefix}.e_score_correction_bias"] = WeightTarget(bias, tuple(bias.shape))
        return targets
