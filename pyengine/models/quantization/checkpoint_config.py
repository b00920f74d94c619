"""What a checkpoint's ``quantization_config`` (config.json) asks for, checked once.

GPTQ (``quant_method: gptq``, 4 or 8 bits, any group size, act-order ``desc_act``,
symmetric or with zeros, checkpoint_format ``gptq`` or ``gptq_v2``) and AWQ (``awq``,
4 bits, ``version: gemm``, with zero points) are read here; compressed-tensors and
DeepSeek's ``fp8`` in ``compressed_config.py``; anything else (bitsandbytes, other settings) is a :class:`QuantizationError` naming the method and
the setting, before any tensor is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from pyengine.models.quantization.compressed_config import (
    CompressedTensorsScheme,
    compressed_tensors_scheme,
    deepseek_fp8_scheme,
)
from pyengine.models.quantization.packed import QuantizationError


@dataclass(frozen=True)
class CheckpointQuantization:
    """A supported ``quantization_config``: the method and the settings its tensors need."""

    method: str  # "gptq" or "awq"
    bits: int
    group_size: int  # -1: one group per output channel
    zero_offset: int = 0  # GPTQ's format stores zeros minus one (1); gptq_v2 and AWQ store them as they are (0)
    modules_to_not_convert: tuple[str, ...] = ()


def checkpoint_quantization(
        raw_config: dict[str, Any]) -> Optional[Union[CheckpointQuantization, CompressedTensorsScheme]]:
    """The checkpoint's quantization (None for a float checkpoint)."""
    settings = raw_config.get("quantization_config")
    if not settings:
        return None
    if not isinstance(settings, dict):
        raise QuantizationError(f"quantization_config must be an object, got {settings!r}")
    method = str(settings.get("quant_method", "")).lower()
    if method == "gptq":
        return _gptq(settings)
    if method == "awq":
        return _awq(settings)
    if method == "compressed-tensors":
        return compressed_tensors_scheme(settings)
    if method == "fp8":
        return deepseek_fp8_scheme(settings)
    raise QuantizationError(
        f"quantization_config: quant_method {method or settings.get('quant_method')!r} is not supported "
        "(supported: gptq, awq, compressed-tensors, fp8, and GGUF files)"
    )


def _gptq(settings: dict[str, Any]) -> CheckpointQuantization:
    bits = settings.get("bits")
    if bits not in (4, 8):
        raise QuantizationError(f"quantization_config: GPTQ bits={bits!r} is not supported (4 or 8)")
    checkpoint_format = settings.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise QuantizationError(
            f"quantization_config: GPTQ checkpoint_format={checkpoint_format!r} is not supported (gptq, gptq_v2)"
        )
    return CheckpointQuantization("gptq", int(bits), _group(settings, "GPTQ"),
                                  zero_offset=1 if checkpoint_format == "gptq" else 0,
                                  modules_to_not_convert=tuple(settings.get("modules_to_not_convert") or ()))


def _awq(settings: dict[str, Any]) -> CheckpointQuantization:
    bits = settings.get("bits", settings.get("w_bit"))
    version = str(settings.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise QuantizationError(
            f"quantization_config: AWQ bits={bits!r}, version={version!r} is not supported (4 bits, version 'gemm')"
        )
    if settings.get("zero_point", True) is not True:
        raise QuantizationError("quantization_config: AWQ zero_point=false is not supported")
    return CheckpointQuantization("awq", 4, _group(settings, "AWQ", "q_group_size"),
                                  modules_to_not_convert=tuple(settings.get("modules_to_not_convert") or ()))


def _group(settings: dict[str, Any], what: str, alias: str = "group_size") -> int:
    group = settings.get("group_size", settings.get(alias, -1))
    if not isinstance(group, int) or (group <= 0 and group != -1):
        raise QuantizationError(f"quantization_config: {what} group_size={group!r} must be a positive integer or -1")
    return group
