"""The one place that decides which kernel multiplies a quantized weight: device + format
(+ an explicit request) -> kernel, and the weight repacked for it.

| format | CPU (default) | CPU (explicit) | CUDA (default) | needs on CUDA |
| --- | --- | --- | --- | --- |
| ``int8`` (per channel) | ``native`` | ``int8pack`` | ``int8pack`` | any GPU torch runs on |
| ``int4`` (groups)      | ``native`` | ``int4pack`` | ``int4pack`` | compute capability 8.0+ (tinygemm) |
| ``fp8`` (per channel)  | ``scaled_mm`` | ``scaled_mm`` | ``scaled_mm`` | compute capability 8.9+ (Ada, Hopper) |

- ``native``: pyengine's CPU kernels on a ``PackedWeight`` (``gemv``; dequantize-then-matmul
  where they do not apply). Any packed checkpoint format (GPTQ, AWQ, GGUF, ...) runs here.
- ``int8pack`` / ``int4pack``: PyTorch's ``_weight_int8pack_mm`` / tinygemm
  (``torch_kernels``); ``scaled_mm``: ``torch._scaled_mm`` on an ``Fp8Weight`` (``fp8``).

Anything else (another device type, a kernel for another format, fp8 below compute
capability 8.9) is a ``QuantizationError`` naming the method, the device and the reason.
``choose_kernel`` is a pure function of a ``KernelTarget`` so the CUDA decisions are
tested without a GPU; ``KernelTarget.of`` reads the real device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from pyengine.models.quantization.fp8 import Fp8Weight
from pyengine.models.quantization.packed import PackedWeight, QuantizationError
from pyengine.models.quantization.torch_kernels import Int4PackWeight, Int8PackWeight

__all__ = ["KERNELS", "KernelTarget", "LinearWeight", "choose_kernel", "prepare_weight"]

#: Kernel name -> what it is (for messages and docs).
KERNELS = {
    "native": "pyengine's CPU kernels on PackedWeight",
    "int8pack": "torch._weight_int8pack_mm",
    "int4pack": "torch._weight_int4pack_mm (tinygemm)",
    "scaled_mm": "torch._scaled_mm (float8 e4m3, row-wise scales)",
}
#: Format -> the kernels that can multiply it.
_FOR_FORMAT = {"int8": ("native", "int8pack"), "int4": ("native", "int4pack"), "fp8": ("scaled_mm",)}
_CUDA_DEFAULT = {"int8": "int8pack", "int4": "int4pack", "fp8": "scaled_mm"}
_CPU_DEFAULT = {"int8": "native", "int4": "native", "fp8": "scaled_mm"}
#: Minimum CUDA compute capability per kernel.
_CUDA_CAPABILITY = {"int8pack": (0, 0), "int4pack": (8, 0), "scaled_mm": (8, 9)}

#: What a quantized linear holds: a PackedWeight (native kernels) or a weight repacked for a torch kernel.
LinearWeight = Union[PackedWeight, Fp8Weight, Int8PackWeight, Int4PackWeight]


@dataclass(frozen=True)
class KernelTarget:
    """The device a weight runs on: its type and, for CUDA, its compute capability."""

    device_type: str
    capability: Optional[tuple[int, int]] = None

    @staticmethod
    def of(device: Union[str, torch.device]) -> "KernelTarget":
        device = torch.device(device)
        if device.type != "cuda":
            return KernelTarget(device.type)
        if not torch.cuda.is_available():
            raise QuantizationError(f"quantized weights on device {str(device)!r}: no CUDA device is available")
        major, minor = torch.cuda.get_device_capability(device)
        return KernelTarget("cuda", (major, minor))

    def describe(self) -> str:
        if self.capability is None:
            return f"device {self.device_type!r}"
        return f"device 'cuda' (compute capability {self.capability[0]}.{self.capability[1]})"


def choose_kernel(method: str, target: KernelTarget, requested: Optional[str] = None) -> str:
    """The kernel for weights of ``method`` ("int8", "int4", "fp8") on ``target``:
    ``requested`` when it can run there, else the device's default (see the table)."""
    if method not in _FOR_FORMAT:
        raise QuantizationError(f"no kernel multiplies {method!r} weights; formats: {', '.join(_FOR_FORMAT)}")
    if requested is not None and requested not in KERNELS:
        listed = ", ".join(f"{name!r} ({what})" for name, what in KERNELS.items())
        raise QuantizationError(f"quantization kernel {requested!r} does not exist; kernels: {listed}")
    if target.device_type == "cpu":
        kernel = requested or _CPU_DEFAULT[method]
    elif target.device_type == "cuda":
        kernel = requested or _CUDA_DEFAULT[method]
    else:
        raise QuantizationError(f"quantization={method!r} is not supported on {target.describe()}: its kernels "
                                "run on CPU and CUDA only")
    if kernel not in _FOR_FORMAT[method]:
        raise QuantizationError(f"quantization={method!r}: kernel {kernel!r} ({KERNELS[kernel]}) does not take "
                                f"{method} weights; it takes: {', '.join(_FOR_FORMAT[method])}")
    if target.device_type == "cuda":
        _check_cuda(method, kernel, target)
    return kernel


def _check_cuda(method: str, kernel: str, target: KernelTarget) -> None:
    if kernel == "native":
        raise QuantizationError(f"quantization={method!r}: kernel 'native' ({KERNELS['native']}) runs on CPU only, "
                                f"not on {target.describe()}")
    need = _CUDA_CAPABILITY[kernel]
    have = target.capability or (0, 0)
    if have < need:
        raise QuantizationError(
            f"quantization={method!r} ({KERNELS[kernel]}) needs CUDA compute capability {need[0]}.{need[1]} or "
            f"later; {target.describe()} is older" + ("; use 'int8' or 'int4' there" if method == "fp8" else "")
        )


def prepare_weight(weight: Union[PackedWeight, Fp8Weight], kernel: str,
                   dtype: torch.dtype = torch.float32) -> LinearWeight:
    """``weight`` (on its device) in the layout ``kernel`` reads, for activations of
    ``dtype`` (the torch kernels take their scales in it: converted here, once)."""
    if kernel == "scaled_mm":
        if not isinstance(weight, Fp8Weight):
            raise QuantizationError("kernel 'scaled_mm' takes FP8 weights, got a PackedWeight")
        return weight
    if isinstance(weight, Fp8Weight):
        raise QuantizationError(f"kernel {kernel!r} takes integer weights, got an FP8 weight")
    if kernel == "int8pack":
        return Int8PackWeight(weight, dtype)
    if kernel == "int4pack":
        return Int4PackWeight(weight, dtype)
    return weight
