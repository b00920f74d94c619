"""GPTQ checkpoints (AutoGPTQ / GPTQModel's ``gptq`` format) converted into PackedWeights.

A GPTQ linear [N out, K in] is stored as

- ``qweight`` int32 [K * bits / 32, N]: 32 / bits values of consecutive input rows per
  int32, the first in the lowest bits;
- ``qzeros`` int32 [K / G, N * bits / 32]: the zero points packed the same way along the
  output columns, each stored minus one (the format's historical offset);
- ``scales`` float16 [K / G, N];
- ``g_idx`` int32 [K] (optional): the group of each input channel. With ``desc_act``
  (act-order) the groups are not in input order.

``W[n, k] = scales[g, n] * (q[k, n] - z[g, n])`` with ``g = g_idx[k]``. As a PackedWeight:
``biases = -z * scales``; act-order becomes ``input_perm`` (the input channels sorted by
group, so each group's columns are contiguous). 8-bit values (0..255) are stored signed,
``q - 128``, the zero moved by the same 128. Repacking is one vectorised pass per tensor.
"""

from __future__ import annotations

from typing import Optional

import torch

from pyengine.models.quantization.packed import PackedWeight, QuantizationError


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> int16 values (32 / bits per word, lowest bits first) along ``dim``."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.to(torch.int32).unsqueeze(dim + 1)
    shape = [1] * words.dim()
    shape[dim + 1] = per_word
    values = (words >> shifts.view(shape)) & ((1 << bits) - 1)
    sizes = list(packed.shape)
    sizes[dim] *= per_word
    return values.reshape(sizes).to(torch.int16)


def gptq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: Optional[torch.Tensor],
                bits: int, group_size: int, name: str, zero_offset: int = 1) -> PackedWeight:
    """One GPTQ linear as a PackedWeight (see the module docstring); ``zero_offset`` 1 for
    the ``gptq`` checkpoint format (zeros stored minus one), 0 for ``gptq_v2``."""
    if bits not in (4, 8):
        raise QuantizationError(f"GPTQ {name}: bits={bits} is not supported (4 or 8)")
    q = unpack_int32(qweight, bits, 0)  # [K, N]
    k, n = q.shape
    group = k if group_size in (-1, 0, None) else group_size
    if k % group:
        raise QuantizationError(f"GPTQ {name}: group_size {group} does not divide in_features {k}")
    zeros = unpack_int32(qzeros, bits, 1)[:, :n].to(torch.float32) + zero_offset  # [K / G, N]
    scale = scales.to(torch.float32)
    if tuple(scale.shape) != (k // group, n) or tuple(zeros.shape) != (k // group, n):
        raise QuantizationError(
            f"GPTQ {name}: scales {list(scale.shape)} / zeros {list(zeros.shape)} do not match "
            f"[{k // group}, {n}] (in_features {k}, group_size {group})"
        )
    perm = act_order_permutation(g_idx, k, group, f"GPTQ {name}")
    if perm is not None:
        q = q.index_select(0, perm)
    q = q.t().contiguous()  # [N, K]
    scale_t, zeros_t = scale.t().contiguous(), zeros.t().contiguous()
    if bits == 8:
        packed = (q - 128).to(torch.int8)
        biases = -(zeros_t - 128.0) * scale_t
    else:
        packed = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
        biases = -zeros_t * scale_t
    return PackedWeight(bits=bits, group_size=group, in_features=k, out_features=n, qweight=packed,
                        scales=scale_t, biases=biases, input_perm=perm)


def act_order_permutation(g_idx: Optional[torch.Tensor], k: int, group: int, name: str) -> Optional[torch.Tensor]:
    """The input permutation act-order needs (None when the groups are in input order)."""
    if g_idx is None:
        return None
    g = g_idx.to(torch.int64)
    if g.shape != (k,):
        raise QuantizationError(f"{name}: g_idx has shape {list(g.shape)}, expected [{k}]")
    if torch.equal(g, torch.arange(k) // group):
        return None
    counts = torch.bincount(g, minlength=k // group)
    if counts.numel() != k // group or bool((counts != group).any()):
        raise QuantizationError(f"{name}: g_idx does not put {group} input channels in each group")
    return torch.argsort(g, stable=True)
