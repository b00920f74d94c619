"""Quantized weights: the shared ``PackedWeight`` form, online quantization at load, and
the linear products over packed weights (see ``docs/quantization.md``)."""

from pyengine.models.quantization.packed import PackedWeight, QuantizationError, reference_matmul

__all__ = ["PackedWeight", "QuantizationError", "reference_matmul"]
