"""The mixture-of-experts fields of a ``config.json`` (Qwen2-MoE, Qwen3-MoE, Mixtral).

Kept apart from ``config.py`` so that the dense families read nothing of it: a dense
config has ``DecoderConfig.moe`` None, a sparse one a :class:`MoeConfig` saying how many
experts, how tokens pick them and which layers have them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pyengine.models.errors import UnsupportedModelError

#: Architectures whose layers may hold experts, and how their checkpoints name them.
MOE_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """Experts of the sparse layers.

    ``sparse_layers`` lists, per decoder layer, whether it routes to experts (else it has
    a dense MLP of ``intermediate_size``, as ``mlp_only_layers`` / ``decoder_sparse_step``
    say). ``shared_expert_intermediate_size`` > 0 adds Qwen2-MoE's shared expert, a
    dense MLP beside the routed ones scaled by ``sigmoid(shared_expert_gate(x))``.
    ``checkpoint_layout``: "qwen" (``mlp.gate``, ``mlp.experts.{e}.gate_proj/up_proj/
    down_proj``) or "mixtral" (``block_sparse_moe.gate``, ``block_sparse_moe.experts.{e}.
    w1/w3/w2``), the names published checkpoints use.
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]
    shared_expert_intermediate_size: int = 0
    checkpoint_layout: str = "qwen"


def parse_moe_config(raw: dict[str, Any], architecture: str, num_layers: int) -> Optional[MoeConfig]:
    """The :class:`MoeConfig` of an MoE architecture (None for the dense ones); raises
    :class:`UnsupportedModelError` naming a field out of range."""
    if architecture not in MOE_ARCHITECTURES:
        return None
    mixtral = architecture == "MixtralForCausalLM"
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; published
    # Qwen checkpoints say num_experts.
    num_experts = raw.get("num_local_experts") if mixtral else raw.get("num_experts", raw.get("num_local_experts"))
    num_experts = _positive_int(num_experts, "num_local_experts" if mixtral else "num_experts")
    top_k = _positive_int(raw.get("num_experts_per_tok"), "num_experts_per_tok")
    if top_k > num_experts:
        raise UnsupportedModelError(f"num_experts_per_tok ({top_k}) must not exceed the number of experts ({num_experts})")
    if mixtral:
        inter = _positive_int(raw.get("intermediate_size"), "intermediate_size")
        return MoeConfig(num_experts, top_k, inter, True, (True,) * num_layers, 0, "mixtral")
    inter = _positive_int(raw.get("moe_intermediate_size"), "moe_intermediate_size")
    step = _positive_int(raw.get("decoder_sparse_step", 1), "decoder_sparse_step")
    dense = set(raw.get("mlp_only_layers") or ())
    sparse = tuple(index not in dense and (index + 1) % step == 0 for index in range(num_layers))
    shared = 0
    if architecture == "Qwen2MoeForCausalLM":
        shared = int(raw.get("shared_expert_intermediate_size") or 0)
        if shared <= 0:
            raise UnsupportedModelError(
                f"shared_expert_intermediate_size must be a positive integer, got {raw.get('shared_expert_intermediate_size')!r}"
            )
    return MoeConfig(num_experts, top_k, inter, bool(raw.get("norm_topk_prob", False)), sparse, shared, "qwen")


def _positive_int(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UnsupportedModelError(f"{name} must be a positive integer, got {value!r}")
    return value
