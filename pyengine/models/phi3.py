"""Phi-3 (``Phi3ForCausalLM``): the Llama-family decoder with fused checkpoint tensors.

Phi-3 checkpoints store q, k and v as one ``qkv_proj`` tensor and the MLP's gate and up as
one ``gate_up_proj`` (gate rows first), the layout pyengine's merged linears already have,
so each is loaded whole into its parameter. Its ``sliding_window`` applies to every layer
and its ``longrope`` (``su``) scaling is ``rope.py``'s. Splitting a fused tensor across
tensor-parallel ranks would need a cut per part, which the loader's one cut per tensor
cannot express yet: tensor parallelism is refused for Phi-3, naming the reason.
"""

from __future__ import annotations

from pyengine.errors import InvalidConfigError
from pyengine.models.config import DecoderConfig
from pyengine.models.decoder import DecoderForCausalLM, DecoderLayer
from pyengine.models.layers import DecoderAttention, GatedMLP, WeightTarget
from pyengine.models.parallel import ParallelContext


def _whole(parameter, name: str) -> dict[str, WeightTarget]:
    return {name: WeightTarget(parameter, tuple(parameter.shape))}


class Phi3Attention(DecoderAttention):
    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        return {
            **_whole(self.qkv_proj.weight, f"{prefix}.qkv_proj.weight"),
            **self.o_proj.weight_targets(f"{prefix}.o_proj"),
        }


class Phi3MLP(GatedMLP):
    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        return {
            **_whole(self.gate_up_proj.weight, f"{prefix}.gate_up_proj.weight"),
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

    def __init__(self, config: DecoderConfig, parallel: ParallelContext | None = None) -> None:
        if parallel is not None and parallel.world_size > 1:
            raise InvalidConfigError(
                f"tensor_parallel_size={parallel.world_size} is not supported for Phi3ForCausalLM yet "
                "(its fused qkv_proj / gate_up_proj tensors are not split across ranks): use 1"
            )
        super().__init__(config, parallel)
