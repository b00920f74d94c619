"""DeepSeek's mixture-of-experts MLP: DeepSeek routing (``deepseek_routing.py``) over the
shared grouped experts (``experts.py``), plus ``n_shared_experts`` always-on experts
run as one dense gated MLP of ``moe_intermediate_size * n_shared_experts`` features.

Checkpoint names as published: ``mlp.gate.weight`` (and V3's
``mlp.gate.e_score_correction_bias``), ``mlp.experts.{e}.gate_proj/up_proj/down_proj``,
``mlp.shared_experts.gate_proj/up_proj/down_proj``. Under tensor parallelism the router
is replicated, every expert and the shared experts keep a slice of their intermediate
features on each rank (with expert parallelism each rank holds whole routed experts of
its own instead, ``experts.py``), and one all-reduce sums the block.
"""

from __future__ import annotations

from typing import Optional

import torch

from pyengine.models.config import DecoderConfig
from pyengine.models.deepseek_routing import DeepseekRouter
from pyengine.models.experts import GroupedExperts
from pyengine.models.layers import GatedMLP, WeightTarget
from pyengine.models.parallel import ParallelContext

_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


class DeepseekMoeBlock(torch.nn.Module):
    """Routed experts plus the shared experts, in place of a dense MLP; a large step runs
    in slices of ``token_chunk`` tokens, as ``GatedMLP`` does."""

    token_chunk = 2048

    def __init__(self, config: DecoderConfig, parallel: ParallelContext) -> None:
        super().__init__()
        moe = config.deepseek_moe
        if moe is None:
            raise ValueError("DeepseekMoeBlock needs a config with DeepSeek expert fields")
        self.parallel = parallel
        self.gate = DeepseekRouter(config.hidden_size, moe)
        self.experts = GroupedExperts(moe.n_routed_experts, config.hidden_size, moe.moe_intermediate_size, parallel)
        self.shared_experts: Optional[GatedMLP] = None
        if moe.n_shared_experts:
            self.shared_experts = GatedMLP(
                config, parallel, moe.moe_intermediate_size * moe.n_shared_experts,
                "moe_intermediate_size x n_shared_experts",
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.token_chunk:
            return self.parallel.all_reduce(self._partial(x))
        return self.parallel.all_reduce(torch.cat([self._partial(part) for part in x.split(self.token_chunk)]))

    def _partial(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_experts is not None:
            out += self.shared_experts.partial(x)
        return out

    def pack_for_cpu(self) -> None:
        """Packs the shared expert's linears; the routed experts stay as loaded (the
        native kernels read that layout, see ``expert_matmuls.py``)."""
        if self.shared_experts is not None:
            self.shared_experts.pack_for_cpu()

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets = {
            **self.gate.weight_targets(f"{prefix}.gate"),
            **self.experts.weight_targets(f"{prefix}.experts", _EXPERT_NAMES),
        }
        if self.shared_experts is not None:
            targets.update(self.shared_experts.weight_targets(f"{prefix}.shared_experts"))
        return targets
