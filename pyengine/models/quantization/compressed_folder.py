"""Fill a model from a compressed-tensors (llm-compressor) or DeepSeek fp8 checkpoint folder.

A quantized linear ``X`` is stored as ``X.weight_packed`` / ``X.weight_scale`` /
``X.weight_shape`` (pack-quantized) or ``X.weight`` plus ``X.weight_scale`` (int- and
float-quantized; DeepSeek: ``X.weight_scale_inv``); ``ct_weights.py`` turns them into one
weight under the name ``X.weight``. A layer the checkpoint's ``ignore`` list kept float has
a plain ``X.weight`` and no scale, and is read as it is, like embeddings and norms.
Activation scales (``X.input_scale``, static FP8) are not used: the products are
weight-only. ``fill.fill_model`` then shards, merges and hands the weights over.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pyengine.models.checkpoint import checkpoint_files, iterate_tensors
from pyengine.models.decoder import DecoderForCausalLM
from pyengine.models.quantization.compressed_config import CompressedTensorsScheme
from pyengine.models.quantization.ct_weights import (
    fp8_dequantized,
    int8_channel_weight,
    pack_quantized_weight,
)
from pyengine.models.quantization.fill import Weight, fill_model
from pyengine.models.quantization.packed import QuantizationError

_PARTS = ("weight_packed", "weight_scale", "weight_scale_inv", "weight_shape", "weight_zero_point", "weight_g_idx",
          "input_scale", "input_zero_point")


def fill_from_compressed_folder(model: DecoderForCausalLM, folder: Path, scheme: CompressedTensorsScheme,
                                allow_bin: bool = True) -> None:
    """Every weight of ``model`` from ``folder``'s tensors (read whole: the quantized
    tensors are a fraction of the float ones)."""
    tensors = dict(iterate_tensors(checkpoint_files(folder, allow_bin=allow_bin)))
    quantized = {name.rpartition(".")[0] for name in tensors if name.endswith("." + scheme.scale_name)}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in tensors.items():
        prefix, _, part = name.rpartition(".")
        if prefix in quantized and part in _PARTS:
            continue
        shapes[name] = tuple(tensor.shape)
    for prefix in quantized:
        shape = tensors.get(f"{prefix}.weight_shape")
        stored = tensors.get(f"{prefix}.weight")
        if shape is None and stored is None:
            raise QuantizationError(f"{scheme.method} ({scheme.format}): {prefix} has a {scheme.scale_name} but "
                                    "neither weight_shape nor weight")
        shapes[f"{prefix}.weight"] = (tuple(int(v) for v in shape.tolist()) if shape is not None
                                      else tuple(stored.shape))

    def part(prefix: str, name: str) -> torch.Tensor:
        if f"{prefix}.{name}" not in tensors:
            raise QuantizationError(f"{scheme.method} ({scheme.format}): {prefix} has a {scheme.scale_name} but no "
                                    f"{name} tensor")
        return tensors[f"{prefix}.{name}"]

    def read(name: str) -> Weight:
        prefix = name.removesuffix(".weight")
        if prefix not in quantized or not name.endswith(".weight"):
            return tensors[name].to(torch.float32)
        scale = part(prefix, scheme.scale_name)
        if scheme.format == "pack-quantized":
            return pack_quantized_weight(part(prefix, "weight_packed"), scale, part(prefix, "weight_shape"),
                                         tensors.get(f"{prefix}.weight_zero_point"),
                                         tensors.get(f"{prefix}.weight_g_idx"), scheme, prefix)
        if scheme.format == "int-quantized":
            return int8_channel_weight(part(prefix, "weight"), scale, prefix)
        return fp8_dequantized(part(prefix, "weight"), scale, scheme, prefix)

    fill_model(model, shapes, read)
