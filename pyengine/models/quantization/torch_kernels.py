"""PyTorch's own weight-only integer kernels over a ``PackedWeight``'s values, repacked
once at load into the layout each wants:

- ``Int8PackWeight``: ``torch._weight_int8pack_mm`` (int8 [N, K], one scale per output
  channel; CPU and CUDA kernels).
- ``Int4PackWeight``: tinygemm, ``torch._weight_int4pack_mm`` on CUDA (its tiled int32
  layout from ``_convert_weight_to_int4pack``, bfloat16 activations, compute capability
  8.0 or later) and ``torch._weight_int4pack_mm_for_cpu`` on CPU (its own uint8 layout from
  ``_convert_weight_to_int4pack_for_cpu``). Both compute ``W = (q - 8) * scale + zero``
  per group (group sizes 32, 64, 128, 256): a PackedWeight's ``scale * q + bias`` is that
  with ``zero = bias + 8 * scale``, exactly.

The packing differs by device, so a weight is repacked for the device it sits on; the CPU
form is what the tests run, the CUDA form is written from the operator's documented input
(uint8 [N, K / 2], the even column in the high nibble) and checked by
``benches/cuda_quantized.py`` where a GPU is lent.
"""

from __future__ import annotations

from typing import Optional

import torch

from pyengine.models.quantization.packed import PackedWeight, QuantizationError, unpack_int4

__all__ = ["INT4PACK_GROUP_SIZES", "Int4PackWeight", "Int8PackWeight"]

INT4PACK_GROUP_SIZES = (32, 64, 128, 256)


class Int8PackWeight:
    """A per-channel symmetric int8 PackedWeight as ``_weight_int8pack_mm`` reads it, its
    scales in ``dtype`` (the activations': the kernel takes them in the input's dtype)."""

    def __init__(self, weight: PackedWeight, dtype: torch.dtype = torch.float32) -> None:
        if weight.bits != 8 or weight.group_size != weight.in_features or weight.biases is not None \
                or weight.input_perm is not None:
            raise QuantizationError(
                "kernel 'int8pack' (torch._weight_int8pack_mm) takes int8 weights with one scale per output "
                f"channel and no biases or permutation; got {weight.bits} bits, group {weight.group_size} of "
                f"{weight.in_features}, biases {weight.biases is not None}, input_perm {weight.input_perm is not None}"
            )
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.qweight = weight.qweight.contiguous()
        self.scales = weight.scales.reshape(-1).to(dtype).contiguous()

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size()

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch._weight_int8pack_mm(rows, self.qweight, _in_dtype(self.scales, x.dtype))
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.to(torch.float32) * self.scales.float().unsqueeze(1)

    def row_values(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ids = ids.to(self.qweight.device)
        scales = self.scales.index_select(0, ids).float()
        return (self.qweight.index_select(0, ids).to(torch.float32) * scales.unsqueeze(1)).to(dtype)


class Int4PackWeight:
    """A 4-bit grouped PackedWeight in tinygemm's layout for its device, its scales and
    zeros in the dtype the kernel multiplies in (bfloat16 on CUDA, ``dtype`` on CPU)."""

    def __init__(self, weight: PackedWeight, dtype: torch.dtype = torch.float32) -> None:
        g = weight.group_size
        if weight.bits != 4 or g not in INT4PACK_GROUP_SIZES or weight.input_perm is not None:
            raise QuantizationError(
                f"kernel 'int4pack' (tinygemm) takes 4-bit weights in groups of {INT4PACK_GROUP_SIZES} with no "
                f"permutation; got {weight.bits} bits, group {g}, input_perm {weight.input_perm is not None}"
            )
        self.out_features, self.in_features, self.group_size = weight.out_features, weight.in_features, g
        self.cuda = weight.qweight.device.type == "cuda"
        biases = weight.biases if weight.biases is not None else torch.zeros_like(weight.scales)
        zeros = biases + 8.0 * weight.scales
        # [K / G, N, 2]: (scale, zero) of each group, groups first, as both kernels read them.
        self.scales_and_zeros = torch.stack([weight.scales, zeros], dim=-1).transpose(0, 1).contiguous()
        q = unpack_int4(weight.qweight)
        if self.cuda:
            self.packed = _pack_for_cuda(q, weight.out_features, weight.in_features)
            self.scales_and_zeros = self.scales_and_zeros.to(torch.bfloat16)
        else:
            self.scales_and_zeros = self.scales_and_zeros.to(dtype)
            self.packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + \
            self.scales_and_zeros.numel() * self.scales_and_zeros.element_size()

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.cuda:
            out = torch._weight_int4pack_mm(rows.to(torch.bfloat16).contiguous(), self.packed, self.group_size,
                                            self.scales_and_zeros).to(x.dtype)
        else:
            out = torch._weight_int4pack_mm_for_cpu(rows.contiguous(), self.packed, self.group_size,
                                                    _in_dtype(self.scales_and_zeros, x.dtype))
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """``W`` as float32 [N, K], read back through the kernel itself (an identity matrix
        multiplied: for the dequantized checkpoints of tests and benches, not a hot path)."""
        dtype = torch.bfloat16 if self.cuda else torch.float32
        eye = torch.eye(self.in_features, dtype=dtype, device=self.packed.device)
        return self(eye).to(torch.float32).t().contiguous()


def _in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (converted once at load to the model's dtype) in ``dtype``: itself, unless a
    caller multiplies activations of another dtype (a conversion per call, then)."""
    return t if t.dtype == dtype else t.to(dtype)


def _pack_for_cuda(q: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """int16 [N, K] nibbles -> ``_convert_weight_to_int4pack``'s tiled int32 layout (the
    largest inner-K tiling of 8, 4, 2 that divides K / 16)."""
    tiles = next((t for t in (8, 4, 2) if k % (t * 16) == 0), None)
    if tiles is None or n % 8:
        raise QuantizationError(f"kernel 'int4pack' on CUDA needs out_features % 8 == 0 and in_features % 32 == 0; "
                                f"got [{n}, {k}]")
    pairs = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous()
    return torch._convert_weight_to_int4pack(pairs, tiles)
