"""Tiny DeepSeek checkpoints with experts (tests and benchmarks), on top of the
``deepseek_v2`` / ``deepseek_v3`` shapes of ``testing/checkpoints.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Experts from layer 1 on (layer 0 dense): 8 routed in 4 groups, top-2 from 2 groups.
DEEPSEEK_MOE: dict[str, Any] = dict(
    first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    n_group=4, topk_group=2,
)


def set_correction_bias(folder: Path, seed: int = 0) -> None:
    """transformers initialises V3's ``e_score_correction_bias`` to zeros: give it values
    (in the checkpoint, which both implementations then read), so that choosing experts by
    the biased scores and weighting them by the unbiased ones is exercised."""
    import torch
    from safetensors.torch import load_file, save_file

    path = Path(folder) / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in tensors.items():
        if name.endswith("e_score_correction_bias"):
            tensors[name] = torch.randn(tensor.shape, generator=generator) * 0.2
    save_file(tensors, path, metadata={"format": "pt"})
