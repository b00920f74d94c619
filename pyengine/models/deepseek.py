"""DeepSeek-V2 / V3: the Llama-family decoder with multi-head latent attention
(``models/mla.py``) in every layer.

The residual stream, norms, embeddings and LM head are ``DecoderForCausalLM``'s; a
layer's MLP is the gated MLP for the first ``first_k_dense_replace`` layers (all of them
in a checkpoint without routed experts), then DeepSeek's experts (``deepseek_moe.py``:
grouped top-k routing, shared experts, ``routed_scaling_factor``; layers
``i % moe_layer_freq == 0``, DeepSeek's rule). The cache holds one latent row per token and
layer (``executor/latent_kv_cache.py``). Published V3 checkpoints carry the
multi-token-prediction layers after the last decoder layer (``model.layers.61`` for 61
layers); generation does not use them and the loader skips them, as transformers does.
"""

from __future__ import annotations

import re

import torch

from pyengine.models.config import DecoderConfig
from pyengine.models.decoder import DecoderForCausalLM
from pyengine.models.deepseek_moe import DeepseekMoeBlock
from pyengine.models.layers import GatedMLP, RMSNorm, WeightTarget
from pyengine.models.mla import LatentAttention, LatentAttentionOp
from pyengine.models.parallel import ParallelContext

_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.")


class DeepseekDecoderLayer(torch.nn.Module):
    """Pre-norm latent attention, then a pre-norm MLP: routed and shared experts
    (``deepseek_moe``) past the first ``first_k_dense_replace`` layers, else dense."""

    def __init__(self, config: DecoderConfig, layer_index: int, parallel: ParallelContext) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LatentAttention(config, layer_index, parallel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = config.deepseek_moe
        sparse = moe is not None and moe.is_moe_layer(layer_index)
        self.mlp: torch.nn.Module = DeepseekMoeBlock(config, parallel) if sparse else GatedMLP(config, parallel)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: LatentAttentionOp,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``DecoderLayer.forward``: returns the MLP's output and the residual stream."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed = self.input_layernorm.add_and_norm(hidden, residual)
        attended = self.self_attn(normed, cos, sin, attention)
        normed = self.post_attention_layernorm.add_and_norm(attended, residual)
        return self.mlp(normed), residual

    def pack_for_cpu(self) -> None:
        self.self_attn.pack_for_cpu()
        self.mlp.pack_for_cpu()

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        return {
            **self.input_layernorm.weight_targets(f"{prefix}.input_layernorm.weight"),
            **self.self_attn.weight_targets(f"{prefix}.self_attn"),
            **self.post_attention_layernorm.weight_targets(f"{prefix}.post_attention_layernorm.weight"),
            **self.mlp.weight_targets(f"{prefix}.mlp"),
        }


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    """DeepSeek-V2 / V2-Lite (``q_lora_rank`` null: one query projection)."""

    def build_layer(self, config: DecoderConfig, layer_index: int, parallel: ParallelContext) -> torch.nn.Module:
        return DeepseekDecoderLayer(config, layer_index, parallel)

    @property
    def num_kv_heads(self) -> int:
        """One latent row per token: the cache's single "head"."""
        return 1

    def is_ignorable_checkpoint_tensor(self, name: str) -> bool:
        """Also the multi-token-prediction layers past the last decoder layer."""
        found = _LAYER_TENSOR.match(name)
        if found is not None and int(found.group(1)) >= self.config.num_hidden_layers:
            return True
        return super().is_ignorable_checkpoint_tensor(name)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1 (sigmoid routing with a correction bias; bf16 conversions: the
    FP8 release is refused at config time)."""
