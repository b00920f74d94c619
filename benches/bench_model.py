"""The model the CPU benchmarks run: a random Qwen3-shaped checkpoint (hidden 256, 4
layers, 4 heads / 2 KV heads of 64, tied embeddings, a 4096-token vocabulary unless a
bench asks for another). One definition, so that the benches' figures compare."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

from pyengine.testing.checkpoints import make_tiny_checkpoint

MODEL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
VOCAB_SIZE = 4096
#: Qwen3-0.6B's shape (28 layers there; benches choose how many), for the comparisons with
#: llama.cpp, whose users run that size on CPU.
QWEN3_0_6B_SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, vocab_size=151936)


def bench_config(architecture: str, model_type: str, **fields: Any) -> dict:
    """The bench model's ``config.json`` (``MODEL``'s shape, ``VOCAB_SIZE``) as
    ``architecture`` / ``model_type``, ``fields`` added or replacing its own: for benches
    that draw the weights at load (``load_format="dummy"``) or change the family."""
    return {"architectures": [architecture], "model_type": model_type, "vocab_size": VOCAB_SIZE, **MODEL,
            "rms_norm_eps": 1e-6, **fields}


def bench_checkpoint(folder: Union[str, Path], vocab_size: int = VOCAB_SIZE, seed: int = 0,
                     shape: Optional[dict] = None) -> Path:
    """The bench model's checkpoint (random weights from ``seed``) written to ``folder``;
    ``shape`` replaces the default shape (``MODEL``)."""
    fields = {k: v for k, v in (shape or MODEL).items() if k != "vocab_size"}
    return make_tiny_checkpoint(folder, "qwen3", seed=seed, vocab_size=vocab_size, **fields)


# Qwen3-0.6B's shapes with 8 of its 28 layers (the 151,936-token tied embedding whole):
# 1.13 GB of float32 weights read per decoded token. The weights are drawn at load
# (load_format="dummy"), so only config.json is written.
QWEN3_06B_SHAPED = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **QWEN3_0_6B_SHAPE, "num_hidden_layers": 8,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}


def qwen3_06b_shaped_folder(folder: Union[str, Path]) -> Path:
    """A folder holding only the Qwen3-0.6B-shaped config.json (load it with load_format="dummy")."""
    import json

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(QWEN3_06B_SHAPED))
    return folder
