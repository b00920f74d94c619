"""Tiny random Hugging Face checkpoints for tests, benchmarks and the built-in default model.

Weights are created and saved by transformers itself, so the reference implementation and
our loader read exactly the same files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Union

from pyengine.testing.tokenizer_factory import BOS_TOKEN, EOS_TOKEN, IM_END_TOKEN, save_tokenizer

# Small shapes that still exercise GQA, explicit head_dim, biases and rope scaling.
TINY_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": dict(
        config_class="LlamaConfig",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
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
    "qwen3": dict(
        config_class="Qwen3Config",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
    ),
}

DEFAULT_VOCAB_SIZE = 512
CHECKPOINT_FORMAT_VERSION = "1"


def make_tiny_checkpoint(
    path: Union[str, Path],
    arch: str = "qwen3",
    *,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_shard_size: Optional[str] = None,
    initializer_range: float = 0.1,
    **overrides: Any,
) -> Path:
    """Write a random ``arch`` checkpoint (float32 safetensors + tokenizer) into ``path``.

    ``overrides`` replace config fields (e.g. ``num_key_value_heads=1``);
    ``max_shard_size`` (e.g. "40KB") writes a sharded checkpoint with an index file.
    """
    import torch
    import transformers

    if arch not in TINY_ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(TINY_ARCHITECTURES)}, got {arch!r}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    token_ids = save_tokenizer(folder, vocab_size)
    fields = {**TINY_ARCHITECTURES[arch], **overrides}
    config_class = getattr(transformers, fields.pop("config_class"))
    config = config_class(
        vocab_size=vocab_size,
        max_position_embeddings=4096,
        initializer_range=initializer_range,
        bos_token_id=token_ids[BOS_TOKEN],
        eos_token_id=token_ids[EOS_TOKEN],
        pad_token_id=token_ids[EOS_TOKEN],
        **fields,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **save_kwargs)
    generation = {
        "eos_token_id": [token_ids[EOS_TOKEN], token_ids[IM_END_TOKEN]],
        "bos_token_id": token_ids[BOS_TOKEN],
    }
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return folder


def default_cache_dir() -> Path:
    """Where :func:`default_tiny_model` keeps its checkpoint (~/.cache/pyengine)."""
    return Path.home() / ".cache" / "pyengine"


@lru_cache(maxsize=None)
def default_tiny_model(arch: str = "qwen3", cache_dir: Optional[Path] = None) -> Path:
    """A tiny checkpoint built once per cache dir and reused (atomic rename on first build)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"tiny-{arch}-v{CHECKPOINT_FORMAT_VERSION}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".tiny-{arch}-", dir=root))
    try:
        make_tiny_checkpoint(staging, arch)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "config.json").exists():  # not a concurrent builder: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
