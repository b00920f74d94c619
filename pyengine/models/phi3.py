"""Phi-3 (``Phi3ForCausalLM``): the Llama-family decoder with fused checkpoint tensors.

Phi-3 checkpoints store q, k and v as one ``qkv_proj`` tensor and the MLP's gate and up as
one ``gate_up_proj`` (gate rows first), the layout pyengine's merged linears already have.
Each is named as one fused target (``ColumnParallelLinear.fused_weight_targets``): the
loader reads it whole and keeps this rank's rows of every part, so under tensor
parallelism q is split by attention heads, k and v by KV heads (or a KV head is
replicated, as for the other families) and gate and up by intermediate features. Its
``sliding_window`` applies to every layer and its ``longrope`` (``su``) scaling is
``rope.py``'s.
"""

from __future__ import annotations

from pyengine.models.config import DecoderConfig
from pyengine.models.decoder import DecoderForCausalLM, DecoderLayer
from pyengine.models.layers import DecoderAttention, GatedMLP, WeightTarget
from pyengine.models.parallel import ParallelContext


class Phi3Attention(DecoderAttention):
    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        return {
            **self.qkv_proj.fused_weight_targets(f"{prefix}.qkv_proj"),
            **self.o_proj.weight_targets(f"{prefix}.o_proj"),
        }


class Phi3MLP(GatedMLP):
    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        return {
            **self.gate_up_proj.fused_weight_targets(f"{prefix}.gate_up_proj"),
            **self.down_proj.weight_targets(f"{prefix}.down_proj"),
        }


class Phi3DecoderLayer(DecoderLayer):
    attention_class = Phi3Attention

    def __init__(self, config: DecoderConfig, layer_index: int, parallel: ParallelContext) -> None:
        super().__init__(config, layer_index, parallel)
        self.mlp = Phi3MLP(config, parallel)


class Phi3ForCausalLM(DecoderForCausalLM):
    """Phi-3 / Phi-3.5 mini and medium (fused qkv and gate_up, longrope)."""

    layer_class = Phi3DecoderLayer
