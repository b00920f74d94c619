"""The product of activations with a ``PackedWeight``, as the linears and the LM head run it.

``QuantizedMatmul`` holds one packed weight and picks the path per call: the native CPU
kernels (``pyengine._kernels``, reading the packed integers directly) where they apply,
else the dequantize-then-matmul reference (``packed.reference_matmul``).
"""

from __future__ import annotations

from typing import Optional

import torch

from pyengine.models.quantization.packed import PackedWeight, QuantizationError, reference_matmul


class QuantizedMatmul:
    """``x W^T (+ bias)`` for a packed ``W`` [N, K]; ``x`` is [rows, K]."""

    def __init__(self, weight: PackedWeight) -> None:
        self.weight = weight

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
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
