"""Online quantization: a float checkpoint's linear weights turned into ``PackedWeight``s
at load (vLLM's ``quantization=`` on an unquantized checkpoint).

- ``"int8"``: weight-only, symmetric, one scale per output channel
  (``scale = max|w| / 127``, ``q = round(w / scale)``, no biases).
- ``"int4"``: weight-only, asymmetric, groups of 128 input features
  (``scale = (max - min) / 15``, ``q = round((w - min) / scale)`` in 0..15,
  ``bias = min``): the min/max form keeps a group's range whole, which a symmetric 4-bit
  grid would halve for one-signed groups.
- ``"fp8"``: float8 e4m3 weights, one scale per output channel (``max|w| / 448``), the
  activations rounded to e4m3 per token at run time (``fp8.py``; vLLM's online fp8).

Which kernel multiplies them is decided in ``kernels.py`` (the device and an optional
explicit choice): ``check_method`` asks it before anything is loaded.

Quantizing a tensor-parallel shard gives the same integers as quantizing the whole weight
and cutting it, as long as a row-parallel shard starts on a group boundary (checked).
"""

from __future__ import annotations

from typing import Optional

import torch

from pyengine.models.quantization.fp8 import Fp8Weight, quantize_fp8
from pyengine.models.quantization.kernels import KernelTarget, choose_kernel
from pyengine.models.quantization.packed import PackedWeight, QuantizationError

#: Methods ``quantization=`` accepts, and their settings (for error messages).
METHODS = {"int8": "weight-only int8, per output channel", "int4": "weight-only int4, group 128, asymmetric",
           "fp8": "float8 e4m3 weights per output channel, dynamic per-token e4m3 activations"}
INT4_GROUP_SIZE = 128


def check_method(method: Optional[str], device: torch.device, kernel: Optional[str] = None,
                 target: Optional[KernelTarget] = None) -> Optional[str]:
    """The kernel that will multiply ``method``'s weights on ``device`` (``kernel`` if it
    can), None without a method; a QuantizationError naming the method, its settings and
    what is supported otherwise. ``target`` stands for the device's capability in tests."""
    if method is None:
        if kernel is not None:
            raise QuantizationError(f"quantization kernel {kernel!r} given without a quantization method")
        return None
    if method not in METHODS:
        listed = ", ".join(f"{name!r} ({what})" for name, what in METHODS.items())
        raise QuantizationError(f"quantization={method!r} is not supported; supported: {listed}")
    return choose_kernel(method, target or KernelTarget.of(device), kernel)


def quantize_weight(weight: torch.Tensor, method: str) -> "PackedWeight | Fp8Weight":
    """``weight`` [N, K] (any float dtype) as a PackedWeight (int8, int4) or an Fp8Weight."""
    if method == "fp8":
        return quantize_fp8(weight)
    w = weight.detach().to(torch.float32)
    if method == "int8":
        return _int8_per_channel(w)
    if method == "int4":
        return _int4_grouped(w, INT4_GROUP_SIZE)
    raise QuantizationError(f"quantization={method!r} is not supported; supported: {', '.join(METHODS)}")


def _int8_per_channel(w: torch.Tensor) -> PackedWeight:
    n, k = w.shape
    scales = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scales).clamp_(-127, 127).to(torch.int8)
    return PackedWeight(bits=8, group_size=k, in_features=k, out_features=n, qweight=q, scales=scales.contiguous())


def _int4_grouped(w: torch.Tensor, group: int) -> PackedWeight:
    n, k = w.shape
    if k % group:
        raise QuantizationError(
            f"quantization='int4' ({METHODS['int4']}) needs in_features divisible by {group}, got {k} "
            "(at tensor parallel size > 1: each rank's share of the input features)"
        )
    grouped = w.view(n, k // group, group)
    low = grouped.amin(dim=-1)
    high = grouped.amax(dim=-1)
    scales = ((high - low) / 15.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round((grouped - low.unsqueeze(-1)) / scales.unsqueeze(-1)).clamp_(0, 15).to(torch.uint8)
    q = q.view(n, k // 2, 2)
    packed = (q[..., 0] | (q[..., 1] << 4)).contiguous()
    return PackedWeight(
        bits=4, group_size=group, in_features=k, out_features=n, qweight=packed, scales=scales.contiguous(),
        biases=low.contiguous(),
    )
