"""The built-in default model: a tiny Qwen3 checkpoint with random weights.

``LLM()`` and ``pyengine generate`` / ``serve`` without a model path run on it, so a fresh
install works with no download. The checkpoint is written by transformers itself (so a
reference implementation and our loader read exactly the same files) with a tokenizer
trained on the spot, built once into ``~/.cache/pyengine`` and reused. Tests and
benchmarks write the other tiny architectures through the same writer
(``pyengine.testing.checkpoints``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Union

from pyengine.models.default_tokenizer import BOS_TOKEN, EOS_TOKEN, IM_END_TOKEN, save_tokenizer

# Small, yet with GQA and an explicit head_dim; ``config_class`` names the transformers class.
DEFAULT_SHAPE: dict[str, Any] = dict(
    config_class="Qwen3Config",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    tie_word_embeddings=False,
)
DEFAULT_VOCAB_SIZE = 512
# Part of the cache folder's name: bump it when the default's files change, so an old
# cached copy is not reused.
CHECKPOINT_FORMAT_VERSION = "1"


def write_random_checkpoint(
    path: Union[str, Path],
    shape: dict[str, Any],
    *,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_shard_size: Optional[str] = None,
    initializer_range: float = 0.1,
) -> Path:
    """Write a random checkpoint of ``shape`` (config fields plus ``config_class``) into
    ``path``: float32 safetensors, config, generation config and tokenizer.

    ``max_shard_size`` (e.g. "40KB") writes a sharded checkpoint with an index file.
    """
    import torch
    import transformers

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    token_ids = save_tokenizer(folder, vocab_size)
    fields = dict(shape)
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
def default_tiny_model(cache_dir: Optional[Path] = None) -> Path:
    """The default checkpoint's folder, built on first use. Concurrent first uses (several
    processes) each build into a staging folder and rename it into place; the first
    rename wins and the others reuse its result."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"tiny-qwen3-v{CHECKPOINT_FORMAT_VERSION}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-qwen3-", dir=root))
    try:
        write_random_checkpoint(staging, DEFAULT_SHAPE)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "config.json").exists():  # not a concurrent builder: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
