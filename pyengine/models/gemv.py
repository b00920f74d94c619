"""Decode-sized products through the native skinny-matrix kernels (``_kernels.gemv_*``).

A decode step multiplies a few rows by every weight once, so its speed is the memory
bandwidth over the weight bytes; oneDNN's and MKL's GEMMs are built for wide inputs and
leave bandwidth unused there. Up to ``MAX_ROWS`` rows (float32 activations on CPU) the
linears call the native kernels, which read the weight once, as stored: float32
[out, in], or a ``PackedWeight``'s integers (int8, or int4 nibbles) with their scales and
biases, decoded in registers (``rust_sched/kernels/src/gemv.rs``). Wider inputs (prefill)
go to oneDNN (float32) or dequantize-then-matmul (packed weights).
"""

from __future__ import annotations

from typing import Optional

import torch

from pyengine import _kernels
from pyengine.models.quantization.packed import PackedWeight

#: Rows up to which the native kernels run (above: the GEMM paths).
MAX_ROWS = 48
#: What every input width and group size must be a multiple of.
CHUNK = 16


def applies(x: torch.Tensor) -> bool:
    """Whether ``x`` [rows, k] goes to the native kernels."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and not x.requires_grad
        and x.shape[1] % CHUNK == 0
    )


def weight_fits(weight: PackedWeight) -> bool:
    """Whether the native kernels take ``weight`` (group size a multiple of 16)."""
    return weight.group_size % CHUNK == 0 and weight.in_features % CHUNK == 0


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x W^T (+ b)`` for a float32 ``weight`` [n, k] (``applies(x)`` holds)."""
    return PreparedProduct(weight, bias)(x, torch.get_num_threads())


def packed_linear(x: torch.Tensor, weight: PackedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x W^T (+ b)`` for a packed ``weight`` (``applies(x)`` and ``weight_fits`` hold)."""
    return PreparedProduct(weight, bias)(x, torch.get_num_threads())


class PreparedProduct:
    """``float_linear`` / ``packed_linear`` of one weight with the arrays the kernel reads
    looked up once (numpy views of the weight's tensors, which must not be replaced
    after): the native decode path's per-layer products, a few microseconds of Python
    less each. ``applies(x)`` must hold for every ``x``; the results are those of the two
    functions, bit for bit (the same kernel on the same arrays)."""

    __slots__ = ("_packed", "_arrays", "_perm", "_group_size", "out_features", "_bias")

    def __init__(self, weight: torch.Tensor | PackedWeight, bias: Optional[torch.Tensor] = None) -> None:
        self._bias = bias
        if isinstance(weight, PackedWeight):
            self._packed = True
            biases = None if weight.biases is None else weight.biases.numpy()
            self._arrays = (weight.qweight.numpy(), weight.scales.numpy(), biases)
            self._perm = weight.input_perm
            self._group_size = weight.group_size
            self.out_features = weight.out_features
        else:
            self._packed = False
            self._arrays = (weight.numpy(), None, None)
            self._perm = None
            self._group_size = 0
            self.out_features = weight.shape[0]

    def native_parts(self) -> Optional[tuple]:
        """``(weight, scales, biases, group_size, bias)`` as ``_kernels.DecodeLayer`` takes a
        linear (numpy arrays; None where absent), or None for a weight whose inputs are
        permuted first (GPTQ's act order), which it does not take."""
        if self._perm is not None:
            return None
        first, scales, biases = self._arrays
        bias = None if self._bias is None else self._bias.detach().numpy()
        return first, scales, biases, self._group_size, bias

    def __call__(self, x: torch.Tensor, threads: int) -> torch.Tensor:
        if self._perm is not None:
            x = x.index_select(1, self._perm)
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        first, scales, biases = self._arrays
        if self._packed:
            _kernels.gemv_quantized(out.numpy(), x.contiguous().numpy(), first, scales, biases, self._group_size,
                                    threads)
        else:
            _kernels.gemv_f32(out.numpy(), x.contiguous().numpy(), first, threads)
        return out if self._bias is None else out.add_(self._bias)
