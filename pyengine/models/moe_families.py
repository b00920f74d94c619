"""The mixture-of-experts families: the Llama-family decoder with ``SparseMoeBlock``s
(``moe.py``) in the layers the config makes sparse; the classes exist so that
``architectures`` maps names to types."""

from __future__ import annotations

from pyengine.models.decoder import DecoderForCausalLM


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    """Qwen1.5-MoE / Qwen2-MoE: qkv bias, softmax top-k routing and a gated shared expert."""


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """Qwen3-MoE: q/k norm, softmax top-k routing (``norm_topk_prob``), no shared expert."""


class MixtralForCausalLM(DecoderForCausalLM):
    """Mixtral: top-2 of 8 experts, weights renormalised, ``block_sparse_moe`` names."""
