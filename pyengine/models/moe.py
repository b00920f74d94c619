"""A mixture-of-experts MLP block: route once, run the experts grouped, add a shared
expert where the family has one.

``SparseMoeBlock`` = router (``router.py``: scores -> top-k ids and weights) + grouped
experts (``experts.py``: the products of all experts as grouped matmuls) + Qwen2-MoE's
optional gated shared expert. ``build_mlp`` picks, per decoder layer, this block or the
dense ``GatedMLP`` (``mlp_only_layers`` / ``decoder_sparse_step``).

Under tensor parallelism the router is replicated (every rank routes alike), each rank
holds a slice of every expert's and of the shared expert's intermediate features (with
expert parallelism: whole routed experts of its own, see ``experts.py``), and the
block's partial outputs are summed by one all-reduce per layer.
"""

from __future__ import annotations

from typing import Optional

import torch

from pyengine.models.config import DecoderConfig
from pyengine.models.experts import GroupedExperts
from pyengine.models.layers import GatedMLP, WeightTarget
from pyengine.models.parallel import ParallelContext
from pyengine.models.router import SoftmaxTopKRouter

_EXPERT_NAMES = {"qwen": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}
_BLOCK_NAMES = {"qwen": "mlp", "mixtral": "block_sparse_moe"}


class SparseMoeBlock(torch.nn.Module):
    """Routed experts (+ shared expert) in place of a layer's dense MLP.

    A large step runs in slices of ``token_chunk`` tokens, like ``GatedMLP``: a prefill
    burst's ``[tokens * k, 2 * intermediate]`` activations stay bounded.
    """

    token_chunk = 2048

    def __init__(self, config: DecoderConfig, parallel: ParallelContext) -> None:
        super().__init__()
        moe = config.moe
        if moe is None:
            raise ValueError("SparseMoeBlock needs a config with moe fields")
        self.parallel = parallel
        self.layout = moe.checkpoint_layout
        #: The block's name in checkpoint tensor names (``model.layers.{i}.<name>``).
        self.checkpoint_name = _BLOCK_NAMES[self.layout]
        #: The experts' gate, up and down projections' names in checkpoint tensor names.
        self.expert_names = _EXPERT_NAMES[self.layout]
        self.gate = SoftmaxTopKRouter(config.hidden_size, moe.num_experts, moe.top_k, moe.norm_topk_prob)
        self.experts = GroupedExperts(moe.num_experts, config.hidden_size, moe.expert_intermediate_size, parallel)
        self.shared_expert: Optional[GatedMLP] = None
        self.shared_expert_gate: Optional[torch.nn.Linear] = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(
                config, parallel, moe.shared_expert_intermediate_size, "shared_expert_intermediate_size"
            )
            self.shared_expert_gate = torch.nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.token_chunk:
            return self.parallel.all_reduce(self._partial(x))
        return self.parallel.all_reduce(torch.cat([self._partial(part) for part in x.split(self.token_chunk)]))

    def _partial(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.partial(x)
        return out

    def pack_for_cpu(self) -> None:
        """Packs the shared expert's linears; the routed experts stay as loaded (the
        native kernels read that layout, see ``expert_matmuls.py``)."""
        if self.shared_expert is not None:
            self.shared_expert.pack_for_cpu()

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        """``prefix`` is the block's own (``model.layers.{i}.{checkpoint_name}``)."""
        targets = {
            **self.gate.weight_targets(f"{prefix}.gate.weight"),
            **self.experts.weight_targets(f"{prefix}.experts", self.expert_names),
        }
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            targets.update(self.shared_expert.weight_targets(f"{prefix}.shared_expert"))
            weight = self.shared_expert_gate.weight
            targets[f"{prefix}.shared_expert_gate.weight"] = WeightTarget(weight, tuple(weight.shape))
        return targets


def build_mlp(config: DecoderConfig, layer_index: int, parallel: ParallelContext) -> torch.nn.Module:
    """The MLP block of decoder layer ``layer_index``: experts where the config makes the
    layer sparse, else the dense gated MLP."""
    if config.moe is not None and config.moe.sparse_layers[layer_index]:
        return SparseMoeBlock(config, parallel)
    return GatedMLP(config, parallel)


def mlp_checkpoint_name(mlp: torch.nn.Module) -> str:
    """The MLP block's name in checkpoint tensor names ("mlp" unless the block says)."""
    return getattr(mlp, "checkpoint_name", "mlp")



