"""Fill a model from a compressed-tensors (llm-compressor) or DeepSeek fp8 checkpoint folder.

A quantized linear ``X`` is stored as ``X.weight_packed`` / ``X.weight_scale`` /
``X.weight_shape`` (pack-quantized) or ``X.weight`` plus ``X.weight_scale`` (int- and
float-quantized; DeepSeek: ``X.weight_scale_inv``); ``ct_weights.py`` turns them into one
weight under the name ``X.weight``. A layer the checkpoint's ``ignore`` list kept float has
a plain ``X.weight`` and no scale, and is read as it is, like embeddings and norms.
Activation scales (``X.input_scale``, static FP8) are not used: the products are
weight-only, except for FP8 weights kept in FP8 (``keep_fp8``: per-tensor and per-channel
``float-quantized``, multiplied by ``torch._scaled_mm`` with dynamic per-token activation
scales); block-scaled FP8 is always dequantized. ``fill.fill_model`` then shards, merges
and hands the weights over.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch

from pyengine.models.checkpoint import checkpoint_files, iterate_tensors
from pyengine.models.decoder import DecoderForCausalLM
from pyengine.models.quantization.compressed_config import CompressedTensorsScheme
from pyengine.models.quantization.ct_weights import (
    fp8_dequantized,
    fp8_kept,
    int8_channel_weight,
    pack_quantized_weight,
)
from pyengine.models.quantization.fill import Weight, fill_model
from pyengine.models.quantization.kernels import KernelTarget, choose_kernel
from pyengine.models.quantization.packed import QuantizationError

_PARTS = ("weight_packed", "weight_scale", "weight_scale_inv", "weight_shape", "weight_zero_point", "weight_g_idx",
          "input_scale", "input_zero_point")


def fill_from_compressed_folder(model: DecoderForCausalLM, folder: Path, scheme: CompressedTensorsScheme,
                                allow_bin: bool = True, keep_fp8: bool = False) -> None:
    """Every weight of ``model`` from ``folder``'s tensors (read whole: the quantized
    tensors are a fraction of the float ones); ``keep_fp8``: see the module docstring."""
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
        if keep_fp8 and fp8_keepable(scheme):
            return fp8_kept(part(prefix, "weight"), scale, scheme, prefix)
        return fp8_dequantized(part(prefix, "weight"), scale, scheme, prefix)

    fill_model(model, shapes, read)


def fp8_keepable(scheme: CompressedTensorsScheme) -> bool:
    """Whether ``scheme``'s weights can stay FP8 (``Fp8Weight``: one scale per row)."""
    return scheme.format == "float-quantized" and scheme.strategy in ("tensor", "channel")


def keeps_fp8(scheme: object, device: Union[torch.device, KernelTarget], kernel: Optional[str] = None) -> bool:
    """Whether a quantized checkpoint (``scheme``: any ``checkpoint_quantization`` result)
    loads its FP8 weights as FP8 on ``target``: on CUDA always where they can (per-tensor
    or per-channel ``float-quantized``; compute capability 8.9+, else a QuantizationError),
    on CPU only when ``kernel="scaled_mm"`` asks (dequantized by default: the float kernels
    are faster there). Block-scaled FP8 is dequantized everywhere; the integer formats run
    on CPU only, and take no kernel choice. ``device`` may be a ``KernelTarget`` (tests
    decide for a CUDA device that is not there); its capability is read last."""
    target = device if isinstance(device, KernelTarget) else KernelTarget(device.type)
    method, bits = getattr(scheme, "method", "?"), getattr(scheme, "bits", "?")
    keepable = isinstance(scheme, CompressedTensorsScheme) and fp8_keepable(scheme)
    is_fp8 = isinstance(scheme, CompressedTensorsScheme) and scheme.format == "float-quantized"
    if kernel is not None and not (is_fp8 and kernel == "scaled_mm"):
        raise QuantizationError(f"quantization kernel {kernel!r} does not apply to this {method} checkpoint "
                                f"({bits} bits): only FP8 checkpoints take a kernel choice ('scaled_mm')")
    if target.device_type != "cpu" and not is_fp8:
        raise QuantizationError(f"{method} checkpoints ({bits} bits) run on CPU only yet: their packed products "
                                f"have no kernel for {target.describe()} (load a float checkpoint there, with "
                                "quantization='int8', 'int4' or 'fp8')")
    if not keepable:
        return False
    if target.device_type == "cpu" and kernel is None:
        return False
    if not isinstance(device, KernelTarget) and device.type == "cuda":
        target = KernelTarget.of(device)
    return choose_kernel("fp8", target, kernel) == "scaled_mm"
