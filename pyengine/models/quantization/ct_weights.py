"""One compressed-tensors (or DeepSeek fp8) linear's tensors as a pyengine weight.

For a linear [N out, K in] llm-compressor stores, by format:

- ``pack-quantized``: ``weight_packed`` int32 [N, K * bits / 32] (32 / bits values of
  consecutive input columns per word, lowest bits first, each stored ``q + 2^(bits-1)``),
  ``weight_scale`` [N, K / G] (channel: [N, 1]), ``weight_shape`` [N, K], and when
  asymmetric ``weight_zero_point`` int32 [N * bits / 32, K / G] (packed the same way along
  the output rows, also offset). ``W = (q - zp) * scale``. An older act-order checkpoint
  also has ``weight_g_idx`` [K] (the group of each input column).
- ``int-quantized``: ``weight`` int8 [N, K] and ``weight_scale`` [N, 1]: ``W = q * scale``.
- ``float-quantized``: ``weight`` float8_e4m3fn [N, K] and ``weight_scale`` of one value
  (tensor), [N, 1] (channel) or [ceil(N / R), ceil(K / C)] (block R x C; DeepSeek's
  ``weight_scale_inv`` is the same): ``W = w * scale``.

The integer formats become :class:`PackedWeight`s, exactly: 4-bit ``q + 8`` is the nibble
PackedWeight stores, with ``biases = -(8 + zp) * scale``; 8-bit ``q`` is its int8 with
``biases = -zp * scale`` (None when symmetric). A channel scale is written at group 128
(or the largest multiple of 16 dividing K, up to 128): the same values repeated, so a
row-parallel shard can cut the input columns and the native kernels take it.

FP8 has no CPU kernel and its values (a 3-bit mantissa over exponents from 2^-9 to 448)
are not one uniform integer grid per group, so no int8 PackedWeight holds them exactly:
they load dequantized, as float tensors in the engine's dtype (4 bytes per weight in
float32 instead of 1).
"""

from __future__ import annotations

from typing import Optional

import torch

from pyengine.models.quantization.compressed_config import CompressedTensorsScheme
from pyengine.models.quantization.fp8 import Fp8Weight
from pyengine.models.quantization.gptq import act_order_permutation, unpack_int32
from pyengine.models.quantization.packed import PackedWeight, QuantizationError


def pack_quantized_weight(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor,
                          zero_point: Optional[torch.Tensor], g_idx: Optional[torch.Tensor],
                          scheme: CompressedTensorsScheme, name: str) -> PackedWeight:
    """A ``pack-quantized`` linear as a PackedWeight (see the module docstring)."""
    bits = scheme.bits
    n, k = (int(v) for v in shape.tolist())
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[0] != n or packed.shape[1] * 32 < k * bits:
        raise QuantizationError(f"compressed-tensors {name}: weight_packed {packed.dtype} {list(packed.shape)} "
                                f"does not hold weight_shape [{n}, {k}] at {bits} bits")
    offset = 1 << (bits - 1)
    stored = unpack_int32(packed, bits, 1)[:, :k]  # [N, K], q + offset
    group = scheme.group_size if scheme.strategy == "group" else k
    scale = _scale_matrix(scale, n, k // group if k % group == 0 else -1, name)
    zero = torch.zeros_like(scale)
    if not scheme.symmetric:
        if zero_point is None:
            raise QuantizationError(f"compressed-tensors {name}: asymmetric weights need weight_zero_point")
        zero = (unpack_int32(zero_point, bits, 0)[:n].to(torch.float32) - offset)
        if tuple(zero.shape) != tuple(scale.shape):
            raise QuantizationError(f"compressed-tensors {name}: weight_zero_point unpacks to {list(zero.shape)}, "
                                    f"weight_scale is {list(scale.shape)}")
    perm = act_order_permutation(g_idx, k, group, f"compressed-tensors {name}")
    if perm is not None:
        stored = stored.index_select(1, perm)
    if scheme.strategy == "channel":
        group = _channel_group(k)
        scale, zero = scale.repeat_interleave(k // group, 1), zero.repeat_interleave(k // group, 1)
    if bits == 4:
        qweight = (stored[:, 0::2] | (stored[:, 1::2] << 4)).to(torch.uint8)
        biases: Optional[torch.Tensor] = -(zero + offset) * scale
    else:
        qweight = (stored - offset).to(torch.int8)
        biases = None if scheme.symmetric else -zero * scale
    return PackedWeight(bits=bits, group_size=group, in_features=k, out_features=n, qweight=qweight.contiguous(),
                        scales=scale.contiguous(), biases=None if biases is None else biases.contiguous(),
                        input_perm=perm)


def int8_channel_weight(weight: torch.Tensor, scale: torch.Tensor, name: str) -> PackedWeight:
    """An ``int-quantized`` (W8A8) linear as an int8 PackedWeight: the activations the
    checkpoint would quantize per token stay float (W8A16)."""
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise QuantizationError(f"compressed-tensors {name}: int-quantized weight must be int8 [N, K], got "
                                f"{weight.dtype} {list(weight.shape)}")
    n, k = weight.shape
    group = _channel_group(k)
    scales = _scale_matrix(scale, n, 1, name).repeat_interleave(k // group, 1)
    return PackedWeight(bits=8, group_size=group, in_features=k, out_features=n, qweight=weight.contiguous(),
                        scales=scales.contiguous())


def fp8_kept(weight: torch.Tensor, scale: torch.Tensor, scheme: CompressedTensorsScheme, name: str) -> Fp8Weight:
    """A per-tensor or per-channel ``float-quantized`` linear kept in FP8 (for
    ``torch._scaled_mm``): the stored e4m3 values, the scale as one value per row (a
    per-tensor scale repeated: exact)."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise QuantizationError(f"{scheme.method} {name}: FP8 weight must be float8_e4m3fn [N, K], got "
                                f"{weight.dtype} {list(weight.shape)}")
    n = weight.shape[0]
    s = scale.to(torch.float32)
    if scheme.strategy == "tensor":
        if s.numel() != 1:
            raise QuantizationError(f"{scheme.method} {name}: a per-tensor scale has one value, got {list(s.shape)}")
        return Fp8Weight(weight.contiguous(), s.reshape(1, 1).expand(n, 1).contiguous())
    if scheme.strategy == "channel":
        return Fp8Weight(weight.contiguous(), _scale_matrix(s, n, 1, name).contiguous())
    raise QuantizationError(f"{scheme.method} {name}: only per-tensor and per-channel FP8 weights are kept in FP8 "
                            f"(strategy {scheme.strategy!r} is dequantized)")


def fp8_dequantized(weight: torch.Tensor, scale: torch.Tensor, scheme: CompressedTensorsScheme,
                    name: str) -> torch.Tensor:
    """A ``float-quantized`` (or DeepSeek fp8) linear's float32 values, ``w * scale``."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise QuantizationError(f"{scheme.method} {name}: FP8 weight must be float8_e4m3fn [N, K], got "
                                f"{weight.dtype} {list(weight.shape)}")
    n, k = weight.shape
    values = weight.to(torch.float32)
    s = scale.to(torch.float32)
    if scheme.strategy == "tensor":
        if s.numel() != 1:
            raise QuantizationError(f"{scheme.method} {name}: a per-tensor scale has one value, got {list(s.shape)}")
        return values * s.reshape(())
    if scheme.strategy == "channel":
        return values * _scale_matrix(s, n, 1, name)
    rows, cols = scheme.block
    want = (-(-n // rows), -(-k // cols))
    if tuple(s.shape) != want:
        raise QuantizationError(f"{scheme.method} {name}: block scale {list(s.shape)} does not match {list(want)} "
                                f"(weight [{n}, {k}] in {rows} x {cols} blocks)")
    full = s.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
    return values * full


def _scale_matrix(scale: torch.Tensor, n: int, groups: int, name: str) -> torch.Tensor:
    s = scale.to(torch.float32)
    if groups <= 0 or tuple(s.shape) != (n, groups):
        raise QuantizationError(f"compressed-tensors {name}: weight_scale {list(s.shape)} does not match "
                                f"[{n}, {groups if groups > 0 else '?'}] (its group size must divide in_features)")
    return s


def _channel_group(k: int) -> int:
    """The group a per-channel scale is written at (see the module docstring)."""
    for group in (128, 112, 96, 80, 64, 48, 32, 16):
        if k % group == 0:
            return group
    return k
