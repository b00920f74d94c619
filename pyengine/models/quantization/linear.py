"""The product of activations with a ``PackedWeight``, as the linears and the LM head run it.

``QuantizedMatmul`` holds one packed weight and picks the path per call: the native CPU
kernels (``pyengine.models.gemv``: up to 48 float32 rows, the packed integers read as
stored, no repacking at load) where they apply, else the dequantize-then-matmul reference
(``packed.reference_matmul``: prefill, other dtypes, group sizes not a multiple of 16).
"""

from __future__ import annotations

from typing import Optional

import torch

from pyengine.models import gemv
from pyengine.models.quantization.packed import PackedWeight, QuantizationError, reference_matmul


class QuantizedMatmul:
    """``x W^T (+ bias)`` for a packed ``W`` [N, K]; ``x`` is [rows, K]."""

    def __init__(self, weight: PackedWeight) -> None:
        self.weight = weight
        tensors = [weight.qweight, weight.scales, weight.biases]
        self.native = gemv.weight_fits(weight) and all(
            t is None or (t.device.type == "cpu" and t.is_contiguous()) for t in tensors
        )

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.native and gemv.applies(x):
            return gemv.packed_linear(x, self.weight, bias)
        return reference_matmul(x, self.weight, bias)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of ``W`` dequantized (a tied embedding's lookup): [len(ids), K]."""
        w = self.weight
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
