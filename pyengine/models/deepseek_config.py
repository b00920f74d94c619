"""The DeepSeek-V2 / V3 fields of ``config.json``: multi-head latent attention and the
routed experts, checked once, with messages naming the field.

Defaults are the published configs' (and transformers'): V2 scores experts by softmax
and picks them greedily (or ``group_limited_greedy``); V3 scores by sigmoid and picks by
``noaux_tc`` (group scores from the two best experts of each group, plus the
``e_score_correction_bias`` for choosing, not for weighting). ``q_lora_rank`` null
(V2-Lite) means one query projection instead of the low-rank pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from pyengine.models.errors import UnsupportedModelError
from pyengine.models.rope_yarn import yarn_softmax_scale

if TYPE_CHECKING:
    from pyengine.models.config import RopeConfig

DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
#: (scoring_func, topk_method) pairs DeepSeek's models define.
ROUTING_METHODS = (("softmax", "greedy"), ("softmax", "group_limited_greedy"), ("sigmoid", "noaux_tc"))


@dataclass(frozen=True, slots=True)
class MlaConfig:
    """Shape of multi-head latent attention: each token's keys and values are one
    ``kv_lora_rank`` latent (plus a ``qk_rope_head_dim`` rotary key shared by the heads),
    expanded per head by ``kv_b_proj``."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: Optional[int]
    rope_interleave: bool  # rotary pairs (x0, x1), (x2, x3)... as DeepSeek's weights lay them out
    softmax_scale: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values the cache holds per token and layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class DeepseekMoeConfig:
    """Routed and shared experts, and which layers have them."""

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_group: int
    topk_group: int
    scoring_func: str
    topk_method: str
    norm_topk_prob: bool
    routed_scaling_factor: float

    def is_moe_layer(self, layer_index: int) -> bool:
        """DeepSeek's rule: the first ``first_k_dense_replace`` layers are dense, then every
        ``moe_layer_freq``-th layer has experts."""
        return layer_index >= self.first_k_dense_replace and layer_index % self.moe_layer_freq == 0


def parse_mla(raw: dict[str, Any], architecture: str, rope: "RopeConfig") -> MlaConfig:
    """The attention fields; transformers' defaults where a field is absent."""
    if raw.get("attention_bias"):
        raise UnsupportedModelError(f"attention_bias: true is not supported for {architecture}")
    q_lora_rank = raw.get("q_lora_rank", 1536)
    if q_lora_rank is not None:
        q_lora_rank = _positive(raw, "q_lora_rank", q_lora_rank)
    nope = _positive(raw, "qk_nope_head_dim", raw.get("qk_nope_head_dim", 128))
    rope_dim = _positive(raw, "qk_rope_head_dim", raw.get("qk_rope_head_dim", 64))
    if rope_dim % 2:
        raise UnsupportedModelError(f"qk_rope_head_dim must be even, got {rope_dim}")
    # transformers' V2 always rotates interleaved pairs; V3 follows rope_interleave (default true).
    interleave = architecture == "DeepseekV2ForCausalLM" or bool(raw.get("rope_interleave", True))
    return MlaConfig(
        kv_lora_rank=_positive(raw, "kv_lora_rank", raw.get("kv_lora_rank", 512)),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=_positive(raw, "v_head_dim", raw.get("v_head_dim", 128)),
        q_lora_rank=q_lora_rank,
        rope_interleave=interleave,
        softmax_scale=yarn_softmax_scale(rope, nope + rope_dim),
    )


def parse_deepseek_moe(raw: dict[str, Any], architecture: str, num_layers: int) -> Optional[DeepseekMoeConfig]:
    """The experts' fields; None when no layer has experts (``n_routed_experts`` null or
    ``first_k_dense_replace`` >= the layer count)."""
    v3 = architecture == "DeepseekV3ForCausalLM"
    experts = raw.get("n_routed_experts")
    first_dense = int(raw.get("first_k_dense_replace", 3 if v3 else 0) or 0)
    if experts is None or first_dense >= num_layers:
        return None
    scoring = raw.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    method = raw.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if (scoring, method) not in ROUTING_METHODS or (v3 and method != "noaux_tc"):
        supported = "sigmoid + noaux_tc" if v3 else "softmax + greedy / group_limited_greedy"
        raise UnsupportedModelError(
            f"scoring_func {scoring!r} with topk_method {method!r} is not supported for {architecture} "
            f"(supported: {supported})"
        )
    if not v3 and raw.get("norm_topk_prob"):
        raise UnsupportedModelError(
            "norm_topk_prob: true is not supported for DeepseekV2ForCausalLM (the published V2 checkpoints "
            "use false, and implementations disagree on whether it replaces routed_scaling_factor)"
        )
    experts = _positive(raw, "n_routed_experts", experts)
    n_group = _positive(raw, "n_group", raw.get("n_group") or 1)
    topk_group = _positive(raw, "topk_group", raw.get("topk_group") or n_group)
    top_k = _positive(raw, "num_experts_per_tok", raw.get("num_experts_per_tok"))
    if experts % n_group or topk_group > n_group:
        raise UnsupportedModelError(
            f"n_group ({n_group}) must divide n_routed_experts ({experts}) and be >= topk_group ({topk_group})"
        )
    if top_k > topk_group * (experts // n_group):
        raise UnsupportedModelError(
            f"num_experts_per_tok ({top_k}) exceeds the experts of topk_group ({topk_group}) groups"
        )
    return DeepseekMoeConfig(
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=_positive(raw, "moe_intermediate_size", raw.get("moe_intermediate_size")),
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        first_k_dense_replace=first_dense,
        moe_layer_freq=_positive(raw, "moe_layer_freq", raw.get("moe_layer_freq") or 1),
        n_group=n_group,
        topk_group=topk_group,
        scoring_func=scoring,
        topk_method=method,
        norm_topk_prob=bool(raw.get("norm_topk_prob", v3)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
    )


def refuse_deepseek_extras(raw: dict[str, Any], architecture: str) -> None:
    """Fields of published checkpoints that change the weights' meaning and are not
    implemented: quantized weights other than V3's own FP8 release (``quant_method: fp8``,
    read by the quantized-checkpoint loader, which dequantizes it)."""
    quantization = raw.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        if method == "fp8":
            return
        raise UnsupportedModelError(
            f"quantization_config ({method!r}) is not supported for {architecture}: "
            "load a bfloat16 / float16 / float32 conversion of the checkpoint"
        )


def _positive(raw: dict[str, Any], name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UnsupportedModelError(f"{name} must be a positive integer, got {value!r}")
    return value
