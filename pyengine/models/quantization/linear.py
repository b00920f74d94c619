"""The product of activations with a ``PackedWeight``, as the linears and the LM head run it.

``QuantizedMatmul`` holds one packed weight and picks the path per call: the native CPU
kernels (``pyengine.models.gemv``: up to 48 float32 rows, the packed integers read as
stored, no repacking at load) where they apply, else the dequantize-then-matmul reference
(``packed.reference_matmul``: prefill, other dtypes, group sizes not a multiple of 16).
A weight repacked for a torch kernel (``kernels.prepare_weight``: ``Fp8Weight`` through
``torch._scaled_mm``, ``Int8PackWeight`` / ``Int4PackWeight``) always runs that kernel.
"""

from __future__ import annotations

from typing import Optional

import torch

from pyengine.models import gemv
from pyengine.models.quantization.fp8 import Fp8Weight, fp8_linear
from pyengine.models.quantization.kernels import LinearWeight
from pyengine.models.quantization.packed import PackedWeight, QuantizationError, reference_matmul
from pyengine.models.quantization.torch_kernels import Int8PackWeight


class QuantizedMatmul:
    """``x W^T (+ bias)`` for a packed ``W`` [N, K]; ``x`` is [rows, K]."""

    def __init__(self, weight: LinearWeight) -> None:
        self.weight = weight
        if not isinstance(weight, PackedWeight):
            self.native = False
            return
        tensors = [weight.qweight, weight.scales, weight.biases]
        self.native = gemv.weight_fits(weight) and all(
            t is None or (t.device.type == "cpu" and t.is_contiguous()) for t in tensors
        )

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        w = self.weight
        if isinstance(w, PackedWeight):
            if self.native and gemv.applies(x):
                return gemv.packed_linear(x, w, bias)
            return reference_matmul(x, w, bias)
        if isinstance(w, Fp8Weight):
            return fp8_linear(x, w, bias)
        return w(x, bias)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of ``W`` dequantized (a tied embedding's lookup): [len(ids), K]."""
        w = self.weight
        if not isinstance(w, PackedWeight):
            if ids.numel() == 0:
                return torch.empty(0, w.in_features, dtype=dtype, device=ids.device)
            if not isinstance(w, (Fp8Weight, Int8PackWeight)):  # tinygemm's layout has no rows to look up
                raise QuantizationError(f"a tied embedding cannot look rows up in a {type(w).__name__}")
            return w.row_values(ids, dtype)
        if w.input_perm is not None:
            raise QuantizationError("an embedding cannot use a weight with input_perm")
        if ids.numel() == 0:
            return torch.empty(0, w.in_features, dtype=dtype, device=ids.device)
        q = w.qweight.index_select(0, ids)
        part = PackedWeight(
            bits=w.bits, group_size=w.group_size, in_features=w.in_features, out_features=ids.numel(),
            qweight=q, scales=w.scales.index_select(0, ids),
            biases=None if w.biases is None else w.biases.index_select(0, ids),
        )
        return part.dequantize().to(dtype)
