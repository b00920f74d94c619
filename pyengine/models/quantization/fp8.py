"""``Fp8Weight``: a linear's weight kept in float8 e4m3 with one float32 scale per output
channel, multiplied through ``torch._scaled_mm`` (``W[n, k] = scales[n] * q[n, k]``).

- Online (``quantization="fp8"``, as vLLM's online fp8): ``scale = max|w| / 448`` per output
  channel, ``q = w / scale`` rounded to e4m3.
- Checkpoints (compressed-tensors ``float-quantized`` with a per-tensor or per-channel
  scale): the stored e4m3 values as they are, a per-tensor scale repeated over the rows
  (exact), so q/k/v or gate/up parts of different scales merge into one weight.
- The product (``fp8_linear``): each activation row rounded to e4m3 with its own dynamic
  scale (``max|x_row| / 448``), then ``_scaled_mm`` with the row scales and the weight's
  channel scales (row-wise scaling), accumulated in float32. ``emulated_fp8_linear`` is the
  same arithmetic in plain float32 torch: the reference the kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from pyengine.models.quantization.packed import QuantizationError

__all__ = ["FP8_MAX", "Fp8Weight", "emulated_fp8_linear", "fp8_linear", "quantize_fp8"]

#: The largest finite float8 e4m3fn value.
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


@dataclass(frozen=True)
class Fp8Weight:
    """A linear's weight [N out, K in] as float8 e4m3fn ``qweight`` and float32 ``scales``
    [N, 1]. Checked when built."""

    qweight: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        q, s = self.qweight, self.scales
        if not isinstance(q, torch.Tensor) or q.dtype != torch.float8_e4m3fn or q.dim() != 2:
            raise QuantizationError(f"Fp8Weight.qweight must be float8_e4m3fn [N, K], got {_describe(q)}")
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or tuple(s.shape) != (q.shape[0], 1):
            raise QuantizationError(f"Fp8Weight.scales must be float32 [{q.shape[0]}, 1], got {_describe(s)}")

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1])

    @property
    def input_perm(self) -> None:
        """Never permuted (the PackedWeight field the fill path asks about)."""
        return None

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * 4

    def dequantize(self) -> torch.Tensor:
        """``W`` as float32 [N, K]: the float reference."""
        return self.qweight.to(torch.float32) * self.scales

    def to(self, device: torch.device) -> "Fp8Weight":
        return Fp8Weight(self.qweight.to(device), self.scales.to(device))

    def rows(self, start: int, size: int) -> "Fp8Weight":
        """Output rows ``[start, start + size)``."""
        if start < 0 or size < 0 or start + size > self.out_features:
            raise QuantizationError(f"rows [{start}, {start + size}) outside a weight of {self.out_features} rows")
        return Fp8Weight(self.qweight.narrow(0, start, size).contiguous(), self.scales.narrow(0, start, size).contiguous())

    def columns(self, start: int, size: int) -> "Fp8Weight":
        """Input columns ``[start, start + size)`` (any cut: the scales are per row)."""
        if start < 0 or size <= 0 or start + size > self.in_features:
            raise QuantizationError(f"columns [{start}, {start + size}) outside a weight of {self.in_features} columns")
        return Fp8Weight(self.qweight.narrow(1, start, size).contiguous(), self.scales)

    def with_zero_rows(self, extra: int) -> "Fp8Weight":
        """This weight followed by ``extra`` rows of zeros (a vocabulary padded to its
        rank's rows)."""
        if extra == 0:
            return self
        zero = Fp8Weight(torch.zeros((extra, self.in_features), dtype=torch.float8_e4m3fn, device=self.qweight.device),
                         torch.zeros((extra, 1), device=self.scales.device))
        return Fp8Weight.concat_rows([self, zero])

    @staticmethod
    def concat_rows(parts: Sequence["Fp8Weight"]) -> "Fp8Weight":
        """One weight whose rows are the parts' in order (q/k/v, gate/up)."""
        if not parts or len({p.in_features for p in parts}) != 1:
            raise QuantizationError("concat_rows needs one or more FP8 parts of the same input features")
        return Fp8Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]))

    def row_values(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` dequantized (a tied embedding's lookup)."""
        ids = ids.to(self.qweight.device)
        return (self.qweight.index_select(0, ids).to(torch.float32) * self.scales.index_select(0, ids)).to(dtype)


def quantize_fp8(weight: torch.Tensor) -> Fp8Weight:
    """``weight`` [N, K] (any float dtype) with one scale per output channel."""
    q, scales = quantize_rows(weight.detach())  # the activations' per-row form, over output channels
    return Fp8Weight(q.contiguous(), scales.contiguous())


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] as e4m3 with one dynamic float32 scale per row ([M, 1])."""
    xf = x.to(torch.float32)
    scales = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (xf / scales).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scales


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x W^T (+ bias)`` through ``torch._scaled_mm`` (row-wise scales; result in ``x``'s
    dtype). On CUDA row-wise scaling writes bfloat16, so the product is bfloat16 there."""
    if x.shape[-1] != weight.in_features:
        raise QuantizationError(f"input has {x.shape[-1]} features, the weight expects {weight.in_features}")
    rows = x.reshape(-1, x.shape[-1])
    q, scales = quantize_rows(rows)
    out_dtype = torch.bfloat16 if x.device.type == "cuda" else x.dtype
    out = torch._scaled_mm(q, weight.qweight.t(), scale_a=scales, scale_b=weight.scales.t(),
                           bias=None if bias is None else bias.to(out_dtype), out_dtype=out_dtype)
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.out_features)


def emulated_fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``fp8_linear``'s arithmetic in plain float32 torch (the activations rounded the same
    way): what the kernel must give, up to the order of its float32 sums."""
    rows = x.reshape(-1, x.shape[-1])
    q, scales = quantize_rows(rows)
    out = torch.nn.functional.linear(q.to(torch.float32) * scales, weight.dequantize(),
                                     None if bias is None else bias.float())
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.out_features)


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {list(t.shape)}"
    return type(t).__name__
