"""The model the CPU benchmarks run: a random Qwen3-shaped checkpoint (hidden 256, 4
layers, 4 heads / 2 KV heads of 64, tied embeddings, a 4096-token vocabulary unless a
bench asks for another). One definition, so that the benches' figures compare."""

from __future__ import annotations

from pathlib import Path
from typing import Union

from pyengine.testing.checkpoints import make_tiny_checkpoint

MODEL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
VOCAB_SIZE = 4096


def bench_checkpoint(folder: Union[str, Path], vocab_size: int = VOCAB_SIZE, seed: int = 0) -> Path:
    """The bench model's checkpoint (random weights from ``seed``) written to ``folder``."""
    return make_tiny_checkpoint(folder, "qwen3", seed=seed, vocab_size=vocab_size, **MODEL)
