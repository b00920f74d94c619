"""Tiny random Hugging Face checkpoints of every supported architecture, for tests and
benchmarks.

They are written like the built-in default model (``pyengine.models.default_model``, whose
Qwen3 shape is the ``qwen3`` entry here): weights created and saved by transformers
itself, so the reference implementation and our loader read exactly the same files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

from pyengine.models.default_model import DEFAULT_SHAPE, DEFAULT_VOCAB_SIZE, write_random_checkpoint

_DEEPSEEK_DENSE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    first_k_dense_replace=2,
    tie_word_embeddings=False,
)
_DEEPSEEK_YARN: dict[str, Any] = dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=1024,
    beta_fast=32, beta_slow=1,
)
# The shape most tiny architectures share: two layers, grouped-query attention (4 heads, 2 KV heads).
_SMALL_DENSE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
# Qwen2's sliding windows of 20 tokens (not a multiple of the tests' 16-token blocks) on
# the layers from max_window_layers on.
_QWEN2_WINDOWED: dict[str, Any] = dict(
    config_class="Qwen2Config",
    **_SMALL_DENSE,
    use_sliding_window=True,
    sliding_window=20,
    tie_word_embeddings=True,
)

# Small shapes that still exercise GQA, explicit head_dim, biases and rope scaling.
TINY_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": dict(
        config_class="LlamaConfig",
        **_SMALL_DENSE,
        tie_word_embeddings=False,
    ),
    "llama3": dict(
        config_class="LlamaConfig",
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": dict(
        config_class="MistralConfig",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        config_class="Qwen2Config",
        hidden_size=80,
        intermediate_size=144,
        num_hidden_layers=2,
        num_attention_heads=5,
        num_key_value_heads=5,
        tie_word_embeddings=True,
    ),
    "qwen3": dict(DEFAULT_SHAPE),
    # DeepSeek (multi-head latent attention); dense layers only (first_k_dense_replace =
    # num_hidden_layers). V2 without q_lora_rank (V2-Lite's form), V3 with it; YaRN as
    # the published configs use it (V2's mscale != mscale_all_dim scales the rope tables).
    "deepseek_v2": dict(
        config_class="DeepseekV2Config",
        **_DEEPSEEK_DENSE,
        q_lora_rank=None,
        v_head_dim=16,
        rope_parameters={**_DEEPSEEK_YARN, "mscale": 0.707, "mscale_all_dim": 0.9},
    ),
    "deepseek_v3": dict(
        config_class="DeepseekV3Config",
        **_DEEPSEEK_DENSE,
        q_lora_rank=24,
        v_head_dim=12,
        rope_parameters={**_DEEPSEEK_YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
    ),
    # Mixture-of-experts: written per expert (mlp.experts.{e}.gate_proj...), as the
    # published checkpoints are (transformers saves its fused experts that way).
    "qwen3_moe": dict(
        config_class="Qwen3MoeConfig",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    ),
    "qwen2_moe": dict(
        config_class="Qwen2MoeConfig",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=6,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        decoder_sparse_step=2,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    "mixtral": dict(
        config_class="MixtralConfig",
        hidden_size=64,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    # Sliding windows of 20 tokens: not a multiple of the tests' 16-token blocks.
    "mistral_window": dict(
        config_class="MistralConfig",
        **_SMALL_DENSE,
        sliding_window=20,
        tie_word_embeddings=False,
    ),
    "qwen2_window_all": dict(_QWEN2_WINDOWED, max_window_layers=0),  # every layer windowed
    "qwen2_window": dict(_QWEN2_WINDOWED, max_window_layers=1),  # layer 0 full, layer 1 windowed
    # Soft-caps small enough to matter on random weights; query_pre_attn_scalar != head_dim.
    "gemma2": dict(
        config_class="Gemma2Config",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=20,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=8.0,
    ),
    # Layers sliding, full, sliding (pattern 2); local rope base 100, global linear x2.
    "gemma3": dict(
        config_class="Gemma3TextConfig",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=20,
        sliding_window_pattern=2,
        rope_theta=10000.0,
        rope_local_base_freq=100.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
    # longrope: short factors up to 128 positions, long ones past them.
    "phi3": dict(
        config_class="Phi3Config",
        **_SMALL_DENSE,
        original_max_position_embeddings=128,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)],
            "original_max_position_embeddings": 128,
        },
        sliding_window=None,
        tie_word_embeddings=False,
    ),
}


def make_tiny_checkpoint(
    path: Union[str, Path],
    arch: str = "qwen3",
    *,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_shard_size: Optional[str] = None,
    initializer_range: float = 0.1,
    eos_token_ids: Optional[list[int]] = None,
    **overrides: Any,
) -> Path:
    """Write a random ``arch`` checkpoint (float32 safetensors + tokenizer) into ``path``.

    ``overrides`` replace config fields (e.g. ``num_key_value_heads=1``);
    ``max_shard_size`` (e.g. "40KB") writes a sharded checkpoint with an index file;
    ``eos_token_ids`` replace generation_config.json's ``eos_token_id`` (which transformers
    and pyengine both read): tokens the random model emits now and then make sequences end
    by EOS as well as by length.
    """
    if arch not in TINY_ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(TINY_ARCHITECTURES)}, got {arch!r}")
    folder = write_random_checkpoint(
        path,
        {**TINY_ARCHITECTURES[arch], **overrides},
        seed=seed,
        vocab_size=vocab_size,
        max_shard_size=max_shard_size,
        initializer_range=initializer_range,
    )
    if eos_token_ids is not None:
        generation = folder / "generation_config.json"
        config = json.loads(generation.read_text()) if generation.is_file() else {}
        config["eos_token_id"] = list(eos_token_ids)
        generation.write_text(json.dumps(config))
    return folder
