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
from pyengine.models.decoder import DecoderForCausalLM, DecoderLayer
from pyengine.models.deepseek_moe import DeepseekMoeBlock
from pyengine.models.layers import GatedMLP
from pyengine.models.mla import LatentAttention
from pyengine.models.parallel import ParallelContext

_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.")


class DeepseekDecoderLayer(DecoderLayer):
    """``DecoderLayer``'s residual stream and norms around latent attention; the MLP is
    routed and shared experts (``deepseek_moe``) past the first ``first_k_dense_replace``
    layers, else dense. ``attention`` is a ``LatentAttentionOp``."""

    attention_class = LatentAttention

    def build_mlp(self, config: DecoderConfig, layer_index: int, parallel: ParallelContext) -> torch.nn.Module:
        moe = config.deepseek_moe
        sparse = moe is not None and moe.is_moe_layer(layer_index)
        return DeepseekMoeBlock(config, parallel) if sparse else GatedMLP(config, parallel)


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
