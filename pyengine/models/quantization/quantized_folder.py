"""Fill a model from a GPTQ or AWQ checkpoint folder (``quantization_config`` in config.json).

A quantized linear ``X`` is stored as ``X.qweight``, ``X.qzeros``, ``X.scales`` (and GPTQ's
``X.g_idx``) instead of ``X.weight``; those become one PackedWeight (``gptq.py``, ``awq.py``)
under the name ``X.weight``, and everything else (embeddings, norms, an unquantized LM
head) is read as it is. ``fill.fill_model`` then shards, merges and hands them over.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pyengine.models.checkpoint import checkpoint_files, iterate_tensors
from pyengine.models.decoder import DecoderForCausalLM
from pyengine.models.quantization.awq import awq_weight
from pyengine.models.quantization.checkpoint_config import CheckpointQuantization
from pyengine.models.quantization.fill import Weight, fill_model
from pyengine.models.quantization.gptq import gptq_weight

_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def fill_from_quantized_folder(model: DecoderForCausalLM, folder: Path, scheme: CheckpointQuantization,
                               allow_bin: bool = True) -> None:
    """Every weight of ``model`` from ``folder``'s GPTQ / AWQ tensors (read whole: the
    packed tensors are a fraction of the float ones)."""
    tensors = dict(iterate_tensors(checkpoint_files(folder, allow_bin=allow_bin)))
    packed = {name.rpartition(".")[0] for name in tensors if name.endswith(".qweight")}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in tensors.items():
        prefix, _, part = name.rpartition(".")
        if prefix in packed and part in _PARTS:
            continue
        shapes[name] = tuple(tensor.shape)
    for prefix in packed:
        out_features = tensors[f"{prefix}.scales"].shape[1]
        shapes[f"{prefix}.weight"] = (out_features, _in_features(tensors, prefix, scheme))

    def read(name: str) -> Weight:
        prefix = name.removesuffix(".weight")
        if prefix not in packed or not name.endswith(".weight"):
            return tensors[name].to(torch.float32)
        if scheme.method == "awq":
            return awq_weight(tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"], tensors[f"{prefix}.scales"],
                              scheme.bits, scheme.group_size, prefix)
        return gptq_weight(tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"], tensors[f"{prefix}.scales"],
                           tensors.get(f"{prefix}.g_idx"), scheme.bits, scheme.group_size, prefix, scheme.zero_offset)

    fill_model(model, shapes, read)


def _in_features(tensors: dict[str, torch.Tensor], prefix: str, scheme: CheckpointQuantization) -> int:
    qweight = tensors[f"{prefix}.qweight"]
    if scheme.method == "awq":
        return int(qweight.shape[0])
    return int(qweight.shape[0]) * (32 // scheme.bits)
