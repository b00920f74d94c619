"""What a compressed-tensors ``quantization_config`` (as llm-compressor writes it) or a
DeepSeek-style ``quant_method: fp8`` one asks for, checked before any tensor is read.

Read (one weight scheme for every quantized layer; the layers the checkpoint stores as
plain ``weight`` tensors, its ``ignore`` list, stay float):

- ``pack-quantized``: int4 / int8 weights (W4A16, W8A16), ``group`` or ``channel``
  strategy, symmetric or with ``weight_zero_point``; no activation quantization;
- ``int-quantized``: int8 ``channel`` weights with dynamic per-token int8 activations
  (W8A8); run as W8A16 (the activations are not quantized);
- ``float-quantized``: FP8 e4m3 weights, ``tensor``, ``channel`` or ``block`` scales;
  activation quantization (dynamic or static, FP8) is not done;
- DeepSeek-V3's own ``quant_method: fp8`` (``fmt: e4m3``, ``weight_block_size``,
  ``weight_scale_inv``).

Anything else (sparsity, transforms, a KV-cache scheme, other formats such as
``nvfp4-pack-quantized`` or ``sparse-24-bitmask``, several weight schemes in one
checkpoint, other strategies or bit widths) is a :class:`QuantizationError` naming the
format and the setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pyengine.models.quantization.packed import QuantizationError

_FORMATS = ("pack-quantized", "int-quantized", "float-quantized")


@dataclass(frozen=True)
class CompressedTensorsScheme:
    """The one weight scheme of a compressed-tensors (or DeepSeek fp8) checkpoint."""

    method: str  # "compressed-tensors" or "fp8"
    format: str  # "pack-quantized", "int-quantized" or "float-quantized"
    bits: int
    strategy: str  # "group", "channel", "tensor" or "block"
    group_size: int = 0  # group strategy only
    symmetric: bool = True
    block: tuple[int, int] = (0, 0)  # block strategy: [rows, columns] per scale
    scale_name: str = "weight_scale"  # DeepSeek fp8: "weight_scale_inv"
    activations: str = "none"  # what the checkpoint asks for the inputs (not done on CPU), for messages


def compressed_tensors_scheme(settings: dict[str, Any]) -> CompressedTensorsScheme:
    """The scheme of a ``quant_method: compressed-tensors`` config (see the module docstring)."""
    for key in ("sparsity_config", "transform_config"):
        if settings.get(key):
            raise QuantizationError(f"quantization_config: compressed-tensors {key} is not supported (got {settings[key]!r})")
    if settings.get("kv_cache_scheme"):
        raise QuantizationError("quantization_config: compressed-tensors kv_cache_scheme (a quantized KV cache) "
                                "is not supported")
    status = settings.get("quantization_status", "compressed")
    if status != "compressed":
        raise QuantizationError(f"quantization_config: compressed-tensors quantization_status={status!r} is not "
                                "supported (a checkpoint saved uncompressed); 'compressed', as llm-compressor "
                                "saves, is")
    groups = settings.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise QuantizationError("quantization_config: compressed-tensors needs config_groups with a weight scheme")
    schemes = {_group_scheme(name, group, settings.get("format")) for name, group in groups.items()}
    if len(schemes) != 1:
        raise QuantizationError(
            "quantization_config: compressed-tensors with several weight schemes (mixed per-layer schemes: "
            f"{sorted(f'{s.format} {s.bits}-bit {s.strategy}' for s in schemes)}) is not supported; one scheme for "
            "every quantized layer is"
        )
    return schemes.pop()


def deepseek_fp8_scheme(settings: dict[str, Any]) -> CompressedTensorsScheme:
    """DeepSeek-V3's ``quant_method: fp8``: e4m3 weights with ``weight_scale_inv`` blocks."""
    fmt = str(settings.get("fmt", "e4m3")).lower()
    block = settings.get("weight_block_size")
    if fmt != "e4m3" or not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                              for b in block)):
        raise QuantizationError(f"quantization_config: fp8 fmt={fmt!r}, weight_block_size={block!r} is not supported "
                                "(fmt 'e4m3' with weight_block_size [rows, columns])")
    return CompressedTensorsScheme("fp8", "float-quantized", 8, "block", block=(block[0], block[1]),
                                   scale_name="weight_scale_inv",
                                   activations=f"{settings.get('activation_scheme', 'dynamic')} fp8")


def _group_scheme(name: str, group: Any, default_format: Optional[str]) -> CompressedTensorsScheme:
    if not isinstance(group, dict):
        raise QuantizationError(f"quantization_config: compressed-tensors config_groups.{name} must be an object")
    fmt = str(group.get("format") or default_format or "")
    where = f"compressed-tensors config_groups.{name} (format {fmt})"
    if fmt not in _FORMATS:
        raise QuantizationError(f"quantization_config: {where} is not supported; supported formats: "
                                f"{', '.join(_FORMATS)}")
    if group.get("output_activations"):
        raise QuantizationError(f"quantization_config: {where}: output_activations quantization is not supported")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise QuantizationError(f"quantization_config: {where} has no weights scheme")
    kind, bits = str(weights.get("type", "int")), weights.get("num_bits")
    strategy, symmetric = str(weights.get("strategy")), bool(weights.get("symmetric", True))
    if weights.get("dynamic"):
        raise QuantizationError(f"quantization_config: {where}: dynamic weight quantization is not supported")
    activations = _activations(where, fmt, group.get("input_activations"))
    if fmt == "float-quantized":
        if (kind, bits) != ("float", 8) or strategy not in ("tensor", "channel", "block") or not symmetric:
            raise QuantizationError(f"quantization_config: {where}: weights type={kind!r} num_bits={bits!r} "
                                    f"strategy={strategy!r} symmetric={symmetric} is not supported (float 8-bit, "
                                    "symmetric, strategy tensor, channel or block)")
        block = weights.get("block_structure") or [0, 0]
        if strategy == "block" and not (isinstance(block, list) and len(block) == 2 and min(block) > 0):
            raise QuantizationError(f"quantization_config: {where}: block_structure={block!r} must be [rows, columns]")
        return CompressedTensorsScheme("compressed-tensors", fmt, 8, strategy, block=(int(block[0]), int(block[1])),
                                       activations=activations)
    allowed_bits = (4, 8) if fmt == "pack-quantized" else (8,)
    allowed_strategies = ("group", "channel") if fmt == "pack-quantized" else ("channel",)
    if kind != "int" or bits not in allowed_bits or strategy not in allowed_strategies or (
            fmt == "int-quantized" and not symmetric):
        raise QuantizationError(
            f"quantization_config: {where}: weights type={kind!r} num_bits={bits!r} strategy={strategy!r} "
            f"symmetric={symmetric} is not supported (int, {' or '.join(map(str, allowed_bits))} bits, strategy "
            f"{' or '.join(allowed_strategies)}{', symmetric' if fmt == 'int-quantized' else ''})"
        )
    group_size = weights.get("group_size") or 0
    if strategy == "group" and (not isinstance(group_size, int) or group_size <= 0):
        raise QuantizationError(f"quantization_config: {where}: group_size={group_size!r} must be a positive integer")
    return CompressedTensorsScheme("compressed-tensors", fmt, int(bits or 0), strategy,
                                   group_size=int(group_size) if strategy == "group" else 0, symmetric=symmetric,
                                   activations=activations)


def _activations(where: str, fmt: str, inputs: Any) -> str:
    """What the group asks for its inputs; the ones pyengine can ignore (weight-only product)."""
    if not inputs:
        return "none"
    if not isinstance(inputs, dict):
        raise QuantizationError(f"quantization_config: {where}: input_activations must be an object")
    kind, bits, strategy = inputs.get("type", "int"), inputs.get("num_bits"), inputs.get("strategy")
    described = f"{kind} {bits}-bit {strategy}{' dynamic' if inputs.get('dynamic') else ' static'}"
    ok = ((fmt == "int-quantized" and (kind, bits) == ("int", 8) and strategy in ("token", "tensor"))
          or (fmt == "float-quantized" and (kind, bits) == ("float", 8) and strategy in ("token", "tensor", "group")))
    if not ok:
        raise QuantizationError(f"quantization_config: {where}: input_activations {described} is not supported "
                                "(pack-quantized is weight-only; int-quantized takes int8 token/tensor, "
                                "float-quantized fp8 activations, both run unquantized)")
    return described
