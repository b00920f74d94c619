"""AWQ checkpoints (AutoAWQ's ``gemm`` version, int4) converted into PackedWeights.

An AWQ linear [N out, K in] is stored transposed and packed along the output columns:

- ``qweight`` int32 [K, N / 8]: eight 4-bit values per word, word ``c`` holding output
  columns ``8c + order[i]`` in bits ``4i`` with ``order = [0, 2, 4, 6, 1, 3, 5, 7]``
  (the interleave AutoAWQ's GEMM kernel reads);
- ``qzeros`` int32 [K / G, N / 8], the same packing, zeros stored as they are;
- ``scales`` float16 [K / G, N].

``W[n, k] = scales[k // G, n] * (q[k, n] - z[k // G, n])``: a PackedWeight with
``biases = -z * scales`` (the nibbles de-interleaved and transposed at load, one pass).
"""

from __future__ import annotations

import torch

from pyengine.models.quantization.gptq import unpack_int32
from pyengine.models.quantization.packed import PackedWeight, QuantizationError

#: Position within a word -> output column offset (AutoAWQ's packing order).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8] in AWQ's order -> int16 [R, C] in column order."""
    values = unpack_int32(packed, 4, 1).view(packed.shape[0], -1, 8)  # [R, words, position]
    inverse = torch.tensor([AWQ_ORDER.index(column) for column in range(8)])
    return values.index_select(2, inverse).reshape(packed.shape[0], -1)


def awq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
               name: str) -> PackedWeight:
    """One AWQ linear as a PackedWeight (see the module docstring)."""
    if bits != 4:
        raise QuantizationError(f"AWQ {name}: bits={bits} is not supported (AWQ checkpoints are 4-bit)")
    q = unpack_awq(qweight)  # [K, N]
    k, n = q.shape
    group = k if group_size in (-1, 0, None) else group_size
    zeros = unpack_awq(qzeros).to(torch.float32)
    scale = scales.to(torch.float32)
    if k % group or tuple(scale.shape) != (k // group, n) or tuple(zeros.shape) != (k // group, n):
        raise QuantizationError(
            f"AWQ {name}: qweight {list(qweight.shape)}, qzeros {list(qzeros.shape)}, scales {list(scales.shape)} "
            f"do not make a [{n}, {k}] weight with group_size {group}"
        )
    q = q.t().contiguous()
    scale_t, zeros_t = scale.t().contiguous(), zeros.t().contiguous()
    return PackedWeight(bits=4, group_size=group, in_features=k, out_features=n,
                        qweight=(q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8),
                        scales=scale_t, biases=-zeros_t * scale_t)
