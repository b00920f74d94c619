"""``PackedWeight``: one linear's weight stored as integers with per-group scales.

This is the one form every quantized weight takes inside pyengine, whatever it was on
disk (online quantization at load, GPTQ, AWQ, compressed-tensors, GGUF): the loaders
convert into it, the linears and the kernels read from it. For a weight ``W`` of shape
[N out, K in] and a group size ``G`` (``K % G == 0``; ``G == K`` is one group per output
channel)::

    W[n, k] = scales[n, k // G] * q[n, k] + biases[n, k // G]      (biases None: 0)

- ``bits == 8``: ``qweight`` int8 [N, K], ``q`` signed (-128..127).
- ``bits == 4``: ``qweight`` uint8 [N, K // 2], two unsigned nibbles per byte, the low
  nibble holding the even column ``k``; ``q`` in 0..15. (AWQ/GPTQ zero points ``z``:
  ``biases = -z * scales``; GGUF Q4_0: ``biases = -8 * scales``.)
- ``input_perm`` int64 [K] (GPTQ act-order) or None: the layer computes
  ``x[..., input_perm] @ W^T``, ``W``'s columns being in permuted order.

``dequantize`` is the float reference every kernel is tested against; ``reference_matmul``
the plain torch product the linears use where no native kernel applies. ``rows`` and
``columns`` cut the tensor-parallel shards along the same axes as the float weight's
(columns only at group boundaries), ``concat_rows`` merges q/k/v or gate/up parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from pyengine.errors import ModelLoadError

__all__ = ["PackedWeight", "QuantizationError", "reference_matmul", "unpack_int4"]


class QuantizationError(ModelLoadError):
    """A packed weight, or a quantization setting, that pyengine cannot use; the message
    names the method or field and the value."""


@dataclass(frozen=True)
class PackedWeight:
    """A linear's weight [N out, K in] as integers plus per-group scales and biases
    (see the module docstring for the layout). Checked when built."""

    bits: int
    group_size: int
    in_features: int
    out_features: int
    qweight: torch.Tensor
    scales: torch.Tensor
    biases: Optional[torch.Tensor] = None
    input_perm: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def groups(self) -> int:
        """Groups per output row (``K // G``)."""
        return self.in_features // self.group_size

    @property
    def nbytes(self) -> int:
        """Bytes this weight takes (integers, scales, biases, permutation)."""
        tensors = [self.qweight, self.scales, self.biases, self.input_perm]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def integers(self) -> torch.Tensor:
        """``q`` as int16 [N, K] (nibbles unpacked for 4 bits)."""
        if self.bits == 8:
            return self.qweight.to(torch.int16)
        return unpack_int4(self.qweight)

    def dequantize(self) -> torch.Tensor:
        """``W`` as float32 [N, K] (columns in the stored order; see ``input_perm``)."""
        q = self.integers().to(torch.float32).view(self.out_features, self.groups, self.group_size)
        w = q * self.scales.unsqueeze(-1)
        if self.biases is not None:
            w = w + self.biases.unsqueeze(-1)
        return w.reshape(self.out_features, self.in_features)

    def rows(self, start: int, size: int) -> "PackedWeight":
        """Output rows ``[start, start + size)`` (a column-parallel shard, a merged part)."""
        if start < 0 or size < 0 or start + size > self.out_features:
            raise QuantizationError(f"rows [{start}, {start + size}) outside a weight of {self.out_features} rows")
        return PackedWeight(
            bits=self.bits,
            group_size=self.group_size,
            in_features=self.in_features,
            out_features=size,
            qweight=self.qweight.narrow(0, start, size).contiguous(),
            scales=self.scales.narrow(0, start, size).contiguous(),
            biases=None if self.biases is None else self.biases.narrow(0, start, size).contiguous(),
            input_perm=self.input_perm,
        )

    def columns(self, start: int, size: int) -> "PackedWeight":
        """Input columns ``[start, start + size)`` (a row-parallel shard). The cut must fall
        on group boundaries, and a permuted weight cannot be cut (its columns are not in
        input order)."""
        if start < 0 or size <= 0 or start + size > self.in_features:
            raise QuantizationError(f"columns [{start}, {start + size}) outside a weight of {self.in_features} columns")
        if self.input_perm is not None:
            raise QuantizationError("a weight with input_perm (GPTQ act-order) cannot be split by input columns")
        g = self.group_size
        if start % g or size % g:
            raise QuantizationError(
                f"columns [{start}, {start + size}) do not fall on group boundaries (group_size {g}); "
                "tensor parallelism needs each rank's share of the input features to be a multiple of it"
            )
        per_byte = 8 // self.bits
        return PackedWeight(
            bits=self.bits,
            group_size=g,
            in_features=size,
            out_features=self.out_features,
            qweight=self.qweight.narrow(1, start // per_byte, size // per_byte).contiguous(),
            scales=self.scales.narrow(1, start // g, size // g).contiguous(),
            biases=None if self.biases is None else self.biases.narrow(1, start // g, size // g).contiguous(),
        )

    def with_zero_rows(self, extra: int) -> "PackedWeight":
        """This weight followed by ``extra`` rows of zeros (a vocabulary padded to its
        rank's rows)."""
        if extra == 0:
            return self
        zero = PackedWeight(
            bits=self.bits, group_size=self.group_size, in_features=self.in_features, out_features=extra,
            qweight=torch.zeros((extra, self.qweight.shape[1]), dtype=self.qweight.dtype),
            scales=torch.zeros((extra, self.groups)),
            biases=None if self.biases is None else torch.zeros((extra, self.groups)),
            input_perm=self.input_perm,
        )
        return PackedWeight.concat_rows([self, zero])

    def to(self, device: torch.device) -> "PackedWeight":
        """The same weight with its tensors on ``device``."""
        def moved(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t.to(device)
        return PackedWeight(bits=self.bits, group_size=self.group_size, in_features=self.in_features,
                            out_features=self.out_features, qweight=self.qweight.to(device),
                            scales=self.scales.to(device), biases=moved(self.biases),
                            input_perm=moved(self.input_perm))

    @staticmethod
    def concat_rows(parts: Sequence["PackedWeight"]) -> "PackedWeight":
        """One weight whose rows are the parts' in order (q/k/v, gate/up). The parts must
        share bits, group size, input features and permutation, and all have biases or none."""
        if not parts:
            raise QuantizationError("concat_rows needs at least one part")
        first = parts[0]
        for part in parts[1:]:
            same = (part.bits, part.group_size, part.in_features) == (first.bits, first.group_size, first.in_features)
            if not same or (part.biases is None) != (first.biases is None):
                raise QuantizationError(
                    "merged parts must share bits, group_size, in_features and whether they have biases; got "
                    f"{(first.bits, first.group_size, first.in_features)} and "
                    f"{(part.bits, part.group_size, part.in_features)}"
                )
            if not _same_perm(first.input_perm, part.input_perm):
                raise QuantizationError("merged parts must share one input_perm")
        biases = None if first.biases is None else torch.cat([p.biases for p in parts if p.biases is not None])
        return PackedWeight(
            bits=first.bits,
            group_size=first.group_size,
            in_features=first.in_features,
            out_features=sum(p.out_features for p in parts),
            qweight=torch.cat([p.qweight for p in parts]),
            scales=torch.cat([p.scales for p in parts]),
            biases=biases,
            input_perm=first.input_perm,
        )


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] of nibble pairs (low nibble = even column) -> int16 [N, K] in 0..15."""
    low = (qweight & 0x0F).to(torch.int16)
    high = (qweight >> 4).to(torch.int16)
    return torch.stack([low, high], dim=-1).reshape(qweight.shape[0], qweight.shape[1] * 2)


def reference_matmul(x: torch.Tensor, weight: PackedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x W^T (+ bias)`` with ``W`` dequantized (float32 arithmetic, result in ``x``'s
    dtype): the plain torch path and the reference the kernels are tested against."""
    if x.shape[-1] != weight.in_features:
        raise QuantizationError(f"input has {x.shape[-1]} features, the weight expects {weight.in_features}")
    inputs = x if weight.input_perm is None else x.index_select(-1, weight.input_perm)
    w = weight.dequantize().to(x.device)
    out = torch.nn.functional.linear(inputs.to(torch.float32), w, None if bias is None else bias.float())
    return out.to(x.dtype)


def _same_perm(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return bool(torch.equal(a, b))


def _validate(w: PackedWeight) -> None:
    """Every field against the layout; raises QuantizationError naming the field."""
    if w.bits not in (8, 4):
        raise QuantizationError(f"PackedWeight.bits must be 8 or 4, got {w.bits!r}")
    n, k, g = w.out_features, w.in_features, w.group_size
    if n <= 0 or k <= 0:
        raise QuantizationError(f"PackedWeight needs positive in/out features, got in={k}, out={n}")
    if g <= 0 or k % g:
        raise QuantizationError(f"PackedWeight.group_size {g} must divide in_features {k}")
    if w.bits == 4 and k % 2:
        raise QuantizationError(f"a 4-bit PackedWeight needs an even in_features, got {k}")
    want_dtype, want_shape = (torch.int8, (n, k)) if w.bits == 8 else (torch.uint8, (n, k // 2))
    _check_tensor("qweight", w.qweight, want_dtype, want_shape, w.bits)
    _check_tensor("scales", w.scales, torch.float32, (n, k // g), w.bits)
    if w.biases is not None:
        _check_tensor("biases", w.biases, torch.float32, (n, k // g), w.bits)
    if w.input_perm is not None:
        _check_tensor("input_perm", w.input_perm, torch.int64, (k,), w.bits)


def _check_tensor(field: str, t: object, dtype: torch.dtype, shape: tuple[int, ...], bits: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise QuantizationError(f"PackedWeight.{field} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype or tuple(t.shape) != shape:
        raise QuantizationError(
            f"PackedWeight.{field} of a {bits}-bit weight must be {dtype} {list(shape)}, "
            f"got {t.dtype} {list(t.shape)}"
        )
